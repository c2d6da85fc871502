"""Exact integer weights for a float32 .tflite file whose weights are llama.cpp (GGUF) Q8_0 / Q4_1 blocks.

A model converted from a Q8_0 or Q4_1 GGUF (SmolLM2-135M-Instruct: `tfformer.convert.smollm2`) holds float32 weights
that are, block by block (32 consecutive weights along a matrix's input dimension, the contiguous axis of a TFLite
`FULLY_CONNECTED` filter `(out, in)` and of an embedding table's rows), exactly

    Q8_0: d * q          q in -127..127, d float16
    Q4_1: d * q + m      q in 0..15, d and m float16 (float32 arithmetic: the product is exact, the sum rounds once)

`requantize_blocks` finds such constant weights from their float values alone (the file carries no GGUF) and
stores them as integers, so that the rewritten file computes the float32 file's logits to float rounding, unlike
per-channel int8, whose rounding moves them by a sizeable fraction of a logit:

    W (out, in) = RESHAPE(DEQUANTIZE(Q (out*in/32, 32)) * DEQUANTIZE(D (out*in/32, 1)))   # d*q
    FULLY_CONNECTED(x, W_q4_1) = FULLY_CONNECTED(x, d*q) + FULLY_CONNECTED(blocksum(x), M)

with `Q` the integers (quantized with one scale of 1 per tensor: DEQUANTIZE gives q exactly), `D` the per-block
scales d (float16, d's own format; with `block_scales="quantization"` they are instead Q's per-axis quantization
scales, and DEQUANTIZE alone gives d*q), `M (out, in/32)` the block minimums (float16, exact) and `blocksum(x)` the
sums of `x` over each block (RESHAPE to `(rows, in/32, 32)`, SUM over the last axis). Q4_1's q take 4 bits: by
default (`q4_1_bits=8`) they are stored as INT8, like Q8_0's; `q4_1_bits=4` stores them as INT4 (`q - 8` with zero
point -8, still exactly q). A Q4_1 weight is rewritten only when every op that reads it is a `FULLY_CONNECTED`
without a fused activation (the `m` term is added after it); a Q8_0 weight (`d*q` is the weight itself) may feed any
op, e.g. the `GATHER` of a tied embedding table too. Weights that are not such blocks are left as they are.

The converter multiplies a constant per-input scale that precedes a `FULLY_CONNECTED` (an RMSNorm's) into its
filter, `float32(W * g)`, which is no block matrix: given the candidate scales (`input_scales`), such a filter is
stored as W's blocks with `x * g` computed before it again, as the model does. A table stored twice (the embedding
for `GATHER`, and times the final norm's scale for the tied logits) is then stored once.

Costs: a float16 scale per 32-weight block (per-axis quantization would need a float32 scale and an int64 zero point
per block). The runtime dequantizes each constant once (TFLite's DEQUANTIZE kernel keeps the result of a constant
input), so the memory in use stays that of float32 weights: the file is what shrinks. Each step still multiplies
every weight by its scale (MUL) and copies it through its RESHAPE, and XNNPACK does not take a `FULLY_CONNECTED`
whose filter is computed, so a decode step is slower than the float32 file's. (TFLite's `BlockwiseQuantization`,
which would need no RESHAPE, is not read by its DEQUANTIZE kernel.)
"""

import hashlib
import os

import numpy as np

from tfformer.files import write_atomic

BLOCK = 32  # weights per Q8_0 / Q4_1 block (llama.cpp's QK8_0, QK4_1)
Q8_0_MAX = 127
Q4_1_MAX = 15
INT4_ZERO_POINT = -8  # Q4_1's q in 0..15 stored as the int4 q - 8


def _schema():
    from ai_edge_litert import schema_py_generated

    return schema_py_generated


def _blocks_of(values, scale):
    """`(v, approx, g)`: `values` as blocks `(rows, in/32, 32)`, the block values to find (values / scale, in
    float64, when the converter multiplied a per-input `scale` into them) and that scale as `(in/32, 32)` or None."""
    v = np.asarray(values, np.float32)
    v = v.reshape(-1, v.shape[-1] // BLOCK, BLOCK) if v.ndim > 1 else v.reshape(1, -1, BLOCK)
    if scale is None:
        return v, v, None
    g = np.asarray(scale, np.float32).reshape(-1, BLOCK)  # (in/32, 32)
    return v, v.astype(np.float64) / g, g


def _matches(rebuilt, v, g):
    """Per block: does `rebuilt` (float32 block values; times `g` when given, rounded once, as the converter's
    folding does) equal `v` bit for bit."""
    if g is not None:
        rebuilt = rebuilt * g  # float32 * float32: one rounding
    return np.all(rebuilt == v, axis=-1)


def q8_0_blocks(values, scale=None):
    """`values` (`(..., in)`, `in` a multiple of 32, row-major) as Q8_0 blocks, or None.

    Returns `(q, d)`: `q` int8 `(N, 32)` in [-127, 127] and `d` float32 `(N,)` (float16 values, > 0) with
    `d[:, None] * q == values` in float32, bit for bit. llama.cpp's quantizer puts a 127 (or -127) in every block
    that is not all zeros, so `d` is the block's largest magnitude / 127; all-zero blocks get d = 1, q = 0.
    With `scale` (`(in,)`), `values` must instead equal `float32(d * q * scale)` (one rounding of the product):
    the converter folds a per-input multiplication (an RMSNorm's scale) into a `FULLY_CONNECTED` filter.
    """
    v, approx, g = _blocks_of(values, scale)
    if g is not None and not np.all(np.isfinite(approx)):
        return None
    amax = np.abs(approx).max(axis=-1)
    d = (amax / Q8_0_MAX).astype(np.float16).astype(np.float32)
    d[amax == 0] = 1.0
    q = np.clip(np.rint(approx / d[..., None]), -Q8_0_MAX, Q8_0_MAX).astype(np.float32)
    if not np.all(_matches(q * d[..., None], v, g)):
        return None
    return q.astype(np.int8).reshape(-1, BLOCK), d.reshape(-1)


def q4_1_blocks(values, scale=None):
    """`values` (`(..., in)`, `in` a multiple of 32, row-major) as Q4_1 blocks, or None.

    Returns `(q, d, m)`: `q` int8 `(N, 32)` in [0, 15], `d` and `m` float32 `(N,)` (float16 values, d > 0) with
    `float32(d * q + m) == values` bit for bit, computed as llama.cpp does. Its quantizer gives every block's
    minimum q = 0 (so m is the block minimum) and its maximum q = 15, `float32(15 d + m)`: d is the float16 value
    among those that this rounding allows which rebuilds the whole block. `scale`: as for `q8_0_blocks`.
    """
    v, approx, g = _blocks_of(values, scale)
    if g is not None and not np.all(np.isfinite(approx)):
        return None
    low, high = approx.min(axis=-1), approx.max(axis=-1)
    m = low.astype(np.float16).astype(np.float32)
    if g is None and not np.array_equal(m, low):
        return None
    span = high.astype(np.float64) - m  # 15 d, up to the roundings of `15 d + m` (and of the scale's product)
    slack = 2 * np.spacing(np.abs(high).astype(np.float32)).astype(np.float64) + 1e-6 * span
    first = (np.maximum(span - slack, 0) / Q4_1_MAX).astype(np.float16).view(np.uint16).astype(np.int32) - 1
    last = ((span + slack) / Q4_1_MAX).astype(np.float16).view(np.uint16).astype(np.int32) + 1
    q = np.zeros(v.shape, np.float32)
    d = np.ones(low.shape, np.float32)  # blocks of one value (d = 0 in the file) keep q = 0, d = 1
    todo = high > low
    width = int((last - first)[todo].max()) + 1 if todo.any() else 0
    if width > 1024:
        return None  # weights this coarse next to their offset are no GGUF blocks
    if not np.all(_matches(np.broadcast_to(m[..., None], v.shape), v, g)[~todo]):
        return None
    for step in range(width):
        if not todo.any():
            break
        bits = first[todo] + step  # positive float16 values in increasing order
        candidate = np.clip(bits, 1, 0x7BFF).astype(np.uint16).view(np.float16).astype(np.float32)
        guess = np.clip(np.rint((approx[todo] - m[todo][:, None]) / candidate[:, None]), 0, Q4_1_MAX)
        guess = guess.astype(np.float32)
        rebuilt = guess * candidate[:, None]  # exact: at most 4 + 11 significant bits
        rebuilt += m[todo][:, None]  # the one rounding, as llama.cpp's `x*d + m`
        where = np.nonzero(todo)
        ok = _matches(rebuilt, v[where], None if g is None else g[where[-1]])
        chosen = tuple(axis[ok] for axis in where)
        q[chosen], d[chosen] = guess[ok], candidate[ok]
        todo[chosen] = False
    if todo.any():
        return None
    return q.astype(np.int8).reshape(-1, BLOCK), d.reshape(-1), m.reshape(-1)


def _pack_int4(q):
    """int8 values in [-8, 7] -> TFLite INT4 bytes: two per byte, the even element in the low nibble."""
    flat = q.reshape(-1).astype(np.uint8) & 0x0F
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)


class _Editor:
    """Appends tensors, buffers, operator codes and ops to one subgraph of a `ModelT`."""

    def __init__(self, schema, model, subgraph):
        self.s, self.model, self.graph = schema, model, subgraph
        self.ops = []  # the ops of the rewritten subgraph, in order

    def buffer(self, array):
        buffer = self.s.BufferT()
        buffer.data = np.frombuffer(np.ascontiguousarray(array).tobytes(), np.uint8)
        self.model.buffers.append(buffer)
        return len(self.model.buffers) - 1

    def tensor(self, name, shape, dtype, data=None, quantization=None):
        tensor = self.s.TensorT()
        tensor.name, tensor.shape, tensor.type = name, [int(n) for n in shape], dtype
        tensor.buffer = 0 if data is None else self.buffer(data)
        tensor.quantization = quantization
        tensor.hasRank = True
        self.graph.tensors.append(tensor)
        return len(self.graph.tensors) - 1

    def code(self, builtin, version=1):
        for i, code in enumerate(self.model.operatorCodes):
            if max(code.builtinCode, code.deprecatedBuiltinCode) == builtin and code.version >= version:
                return i
        code = self.s.OperatorCodeT()
        code.builtinCode, code.deprecatedBuiltinCode, code.version = builtin, min(builtin, 127), version
        self.model.operatorCodes.append(code)
        return len(self.model.operatorCodes) - 1

    def op(self, builtin, inputs, outputs, options_type=0, options=None, version=1):
        op = self.s.OperatorT()
        op.opcodeIndex = self.code(builtin, version)
        op.inputs, op.outputs = list(inputs), list(outputs)
        op.builtinOptionsType, op.builtinOptions = options_type, options
        self.ops.append(op)
        return op

    def reshape(self, source, target, shape):
        s = self.s
        shape_tensor = self.tensor(f"{self.name(target)}/shape", [len(shape)], s.TensorType.INT32,
                                   np.asarray(shape, np.int32))
        options = s.ReshapeOptionsT()
        options.newShape = [int(n) for n in shape]
        self.op(s.BuiltinOperator.RESHAPE, [source, shape_tensor], [target], s.BuiltinOptions.ReshapeOptions, options)

    def dequantize(self, source, target, version):
        s = self.s
        self.op(s.BuiltinOperator.DEQUANTIZE, [source], [target], s.BuiltinOptions.DequantizeOptions,
                s.DequantizeOptionsT(), version=version)

    def name(self, index):
        name = self.graph.tensors[index].name
        return name.decode("utf-8") if isinstance(name, bytes) else str(name)


def _constant(model, tensor, raw):
    """The float32 values of a constant tensor, or None."""
    if tensor.buffer <= 0 or tensor.buffer >= len(model.buffers):
        return None
    buffer = model.buffers[tensor.buffer]
    if buffer.offset and buffer.offset > 1:
        data = np.frombuffer(raw, np.uint8, count=buffer.size, offset=buffer.offset)
    elif buffer.data is not None and len(buffer.data):
        data = np.asarray(buffer.data, np.uint8)
    else:
        return None
    return np.frombuffer(data.tobytes(), np.float32).reshape([int(n) for n in tensor.shape])


def _decompose(values, scale=None):
    """('q8_0', q, d) or ('q4_1', q, d, m) for a float32 matrix `(rows, k * 32)` of GGUF blocks (times `scale`
    per input feature, when given), else None."""
    if values.ndim != 2 or values.shape[1] % BLOCK or not values.size:
        return None
    if scale is not None and (np.shape(scale) != (values.shape[1],) or not np.all(np.isfinite(scale))
                              or np.any(np.asarray(scale) == 0)):
        return None
    for kind, blocks in (("q8_0", q8_0_blocks), ("q4_1", q4_1_blocks)):
        found = blocks(values, scale)
        if found is not None:
            return (kind,) + found
    return None


def _rebuild(found, shape):
    """The float32 block weights `(rows, in)` of a `_decompose` result."""
    q, d = found[1].astype(np.float32), found[2][:, None]
    w = q * d
    if found[0] == "q4_1":
        w += found[3][:, None]
    return w.reshape(shape)


def requantize_blocks(tflite_path, out_path, q4_1_bits=8, input_scales=(), block_scales="float16"):
    """Rewrite the float32 file `tflite_path` to `out_path` with its GGUF-block weights stored exactly as integers.

    Args:
        tflite_path: a float32 .tflite file, e.g. `tfformer.export.tflite_decoder(model, path)` of a model
            converted from a Q8_0 / Q4_1 GGUF.
        out_path: the file to write (written to a temporary name, then moved into place).
        q4_1_bits: 8 stores Q4_1's q (0..15) as INT8, like Q8_0's; 4 as INT4, two per byte.
        input_scales: float32 vectors `(in,)` that the converter may have multiplied into `FULLY_CONNECTED`
            filters: it folds `FULLY_CONNECTED(x * g)` with a constant `g` (an RMSNorm's scale) into the filter
            `float32(W * g)`, which is no block matrix. A filter that is such a product, bit for bit, with W of
            blocks and `g` one of these, is stored as W's blocks and `x * g` is computed before it again, as the
            model does. Pass the model's normalization scales (its 1-D weights).
        block_scales: where the per-block scales d go. "float16": a float16 tensor `(N, 1)` (d's own format),
            multiplied (MUL) into the integers, which are quantized with one scale of 1 per tensor: 2 bytes per
            32 weights. "quantization": the integers' per-axis quantization parameters, a float32 scale and an
            int64 zero point per block: 12 bytes per 32 weights, no MUL.

    Returns:
        A dict: `q8_0` and `q4_1` (names of the rewritten weight tensors), `unscaled` (those among them whose
        filter held an input scale), `kept` (`(name, reason)` of the float32 `FULLY_CONNECTED` / `GATHER` weights
        left as they are) and `bytes` (the new file's size).
    """
    if q4_1_bits not in (4, 8):
        raise ValueError(f"`q4_1_bits` must be 4 or 8. Received: q4_1_bits={q4_1_bits!r}")
    if block_scales not in ("float16", "quantization"):
        raise ValueError(f"`block_scales` must be 'float16' or 'quantization'. "
                         f"Received: block_scales={block_scales!r}")
    scales = _distinct_scales(input_scales)
    import flatbuffers

    s = _schema()
    with open(tflite_path, "rb") as handle:
        raw = handle.read()
    if not s.Model.ModelBufferHasIdentifier(raw, 0):
        raise ValueError(f"`tflite_path` is not a TFLite flatbuffer (no 'TFL3' identifier): {tflite_path}")
    model = s.ModelT.InitFromPackedBuf(raw, 0)
    codes = [max(c.builtinCode, c.deprecatedBuiltinCode) for c in model.operatorCodes]
    summary = {"q8_0": [], "q4_1": [], "unscaled": [], "kept": []}
    for graph in model.subgraphs:
        _requantize_graph(_Editor(s, model, graph), raw, codes, scales, q4_1_bits, block_scales, summary)
    referenced = {t.buffer for g in model.subgraphs for t in g.tensors}
    for i, buffer in enumerate(model.buffers):
        if i and i not in referenced and buffer.data is not None and len(buffer.data) > 0:
            buffer.data = None  # a float32 weight now stored as integers
    builder = flatbuffers.Builder(1 << 20)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    write_atomic(out_path, builder.Output())
    summary["bytes"] = os.path.getsize(out_path)
    return summary


def _distinct_scales(input_scales):
    """`input_scales` as float32 vectors, each once."""
    scales = []
    for i, scale in enumerate(input_scales):
        scale = np.asarray(scale, np.float32)
        if scale.ndim != 1:
            raise ValueError(f"`input_scales[{i}]` must be a vector (in,); received shape {scale.shape}.")
        if not any(np.array_equal(scale, seen) for seen in scales):
            scales.append(scale)
    return scales


def _requantize_graph(edit, raw, codes, scales, q4_1_bits, block_scales, summary):
    """Store the block weights of one subgraph (`edit.graph`) as integers, noting them in `summary`; `codes`: the
    builtin operator of each operator code."""
    s, model, graph = edit.s, edit.model, edit.graph
    readers = {}  # tensor index -> [(op, input position)]
    for op in graph.operators:
        for position, index in enumerate(op.inputs):
            if index >= 0:
                readers.setdefault(index, []).append((op, position))
    q4_1_readers = {}  # id(FC op) -> (its filter tensor, the dequantized M tensor)
    prescaled = {}  # id(FC op) -> the constant tensor of the input scale to multiply its input by
    stored = {}  # (shape, hash of the block weights) -> (dequantized d*q tensor, M tensor or None)
    for index in _float_weights(s, graph, codes):
        tensor = graph.tensors[index]
        name = edit.name(index)
        values = _constant(model, tensor, raw)
        if values is None:
            continue  # a computed weight (not a constant)
        found, scale, kept = _find_blocks(s, values, readers[index], codes, scales)
        if found is None:
            summary["kept"].append((name, kept))
            continue
        rows, columns = values.shape
        block_weights = values if scale is None else _rebuild(found, values.shape)
        key = (values.shape, hashlib.sha1(block_weights.tobytes()).digest())
        tensor.buffer = 0  # the weight is now computed: RESHAPE writes it
        summary[found[0]].append(name)
        if scale is not None:
            summary["unscaled"].append(name)
            g = edit.tensor(f"{name}/input_scale", [columns], s.TensorType.FLOAT32, scale)
            for op, _ in readers[index]:
                prescaled[id(op)] = g
        if key not in stored:  # else the same block weights under another tensor (a tied table): one integer copy
            stored[key] = _store(edit, name, found, q4_1_bits, block_scales, values.shape)
        scaled, full = stored[key]
        edit.reshape(scaled, index, [rows, columns])  # (out, in): d*q, block by block
        if found[0] == "q4_1":
            for op, _ in readers[index]:
                q4_1_readers[id(op)] = (index, full)
    if stored:
        _insert_ops(edit, prescaled, q4_1_readers)


def _float_weights(s, graph, codes):
    """The float32 weight tensors of a subgraph: `FULLY_CONNECTED` filters and `GATHER` tables, each once."""
    FC, GATHER = s.BuiltinOperator.FULLY_CONNECTED, s.BuiltinOperator.GATHER
    weights = []
    for op in graph.operators:
        code = codes[op.opcodeIndex]
        position = 1 if code == FC else 0 if code == GATHER else None
        if position is None or len(op.inputs) <= position:
            continue
        index = op.inputs[position]
        if index not in weights and graph.tensors[index].type == s.TensorType.FLOAT32:
            weights.append(index)
    return weights


def _find_blocks(s, values, readers, codes, scales):
    """`(found, scale, None)`: the `_decompose` blocks of a constant weight `values` (read by `readers`, `(op,
    input position)`s), times one of the input `scales` or `scale` None; or `(None, None, why it is kept)`."""
    FC = s.BuiltinOperator.FULLY_CONNECTED
    only_fc = all(codes[op.opcodeIndex] == FC and position == 1 for op, position in readers)
    unfused = only_fc and all(getattr(op.builtinOptions, "fusedActivationFunction", 0)
                              == s.ActivationFunctionType.NONE for op, _ in readers)
    found, scale = _decompose(values), None
    if found is None and only_fc and values.ndim == 2:
        for candidate in scales:
            # The first row rules most candidates out cheaply.
            if len(candidate) == values.shape[1] and _decompose(values[:1], candidate) is not None:
                found = _decompose(values, candidate)
                if found is not None:
                    scale = candidate
                    break
    if found is None:
        return None, None, "not Q8_0 / Q4_1 blocks along the last axis (times an input scale)"
    if found[0] == "q4_1" and not unfused:
        return None, None, "Q4_1 blocks read by an op other than an unfused FULLY_CONNECTED"
    return found, scale, None


def _insert_ops(edit, prescaled, q4_1_readers):
    """The subgraph's ops with `x * g` before each `FULLY_CONNECTED` in `prescaled` and the Q4_1 minimum term after
    each in `q4_1_readers` (after the ops `edit` already made: the weights' DEQUANTIZE, MUL and RESHAPE)."""
    s, graph = edit.s, edit.graph
    sums = {}  # input tensor index -> its block sums
    products = {}  # (input, scale tensor) -> the input times the scale
    for op in graph.operators:
        if id(op) in prescaled:
            key = (op.inputs[0], prescaled[id(op)])
            if key not in products:
                x_shape = graph.tensors[op.inputs[0]].shape
                products[key] = edit.tensor(f"{edit.name(op.inputs[0])}/scaled", x_shape, s.TensorType.FLOAT32)
                edit.op(s.BuiltinOperator.MUL, list(key), [products[key]], s.BuiltinOptions.MulOptions,
                        s.MulOptionsT())
            op.inputs = [products[key]] + list(op.inputs[1:])
        edit.ops.append(op)
        if id(op) in q4_1_readers:
            _add_minimum_term(edit, op, *q4_1_readers[id(op)], sums)
    graph.operators = edit.ops


def _store(edit, name, found, q4_1_bits, block_scales, shape):
    """The integer tensors of one block matrix `shape` `(out, in)` and the ops that read them: the float32 d*q
    `(N, 32)` and, for Q4_1, the dequantized minimums `(out, in/32)` (else None)."""
    s = edit.s
    kind, q, d = found[0], found[1], found[2]
    blocks = q.shape[0]
    zero, dtype, data, version = 0, s.TensorType.INT8, q, 2
    if kind == "q4_1" and q4_1_bits == 4:
        zero, dtype, version = INT4_ZERO_POINT, s.TensorType.INT4, 6
        data = _pack_int4(q.astype(np.int16) + INT4_ZERO_POINT)
    quantization = s.QuantizationParametersT()
    quantization.quantizedDimension = 0
    if block_scales == "quantization":
        quantization.scale = d.astype(np.float32)
        quantization.zeroPoint = np.full(blocks, zero, np.int64)
    else:
        # One scale of 1 for the whole tensor: DEQUANTIZE gives q itself, d multiplies it after.
        quantization.scale = np.ones(1, np.float32)
        quantization.zeroPoint = np.full(1, zero, np.int64)
    packed = edit.tensor(f"{name}/{kind}", [blocks, BLOCK], dtype, data, quantization)
    scaled = edit.tensor(f"{name}/{kind}_dequantized", [blocks, BLOCK], s.TensorType.FLOAT32)
    if block_scales == "quantization":
        edit.dequantize(packed, scaled, version)
    else:
        half = d.astype(np.float16)
        if not np.array_equal(half.astype(np.float32), d):
            raise ValueError(f"The block scales of {name} are not float16 values.")
        integers = edit.tensor(f"{name}/{kind}_integers", [blocks, BLOCK], s.TensorType.FLOAT32)
        edit.dequantize(packed, integers, version)  # (N, 32): q as float32, exactly
        stored = edit.tensor(f"{name}/{kind}_scale", [blocks, 1], s.TensorType.FLOAT16, half.reshape(blocks, 1))
        factor = edit.tensor(f"{name}/{kind}_scale_dequantized", [blocks, 1], s.TensorType.FLOAT32)
        edit.dequantize(stored, factor, 3)  # (N, 1)
        # d has 11 significant bits and q at most 8: the float32 product is exact, llama.cpp's float32(d) * q.
        edit.op(s.BuiltinOperator.MUL, [integers, factor], [scaled], s.BuiltinOptions.MulOptions, s.MulOptionsT())
    if kind != "q4_1":
        return scaled, None
    minimums = found[3].astype(np.float16).reshape(shape[0], shape[1] // BLOCK)  # (out, in/32)
    half = edit.tensor(f"{name}/q4_1_min", minimums.shape, s.TensorType.FLOAT16, minimums)
    full = edit.tensor(f"{name}/q4_1_min_dequantized", minimums.shape, s.TensorType.FLOAT32)
    edit.dequantize(half, full, 3)
    return scaled, full


def _add_minimum_term(edit, op, weight, minimums, sums):
    """After `op` (FULLY_CONNECTED reading the d*q part of a Q4_1 weight): add `blocksum(x) @ M^T` to its output."""
    s, graph = edit.s, edit.graph
    rows_out, columns = graph.tensors[weight].shape
    x = op.inputs[0]
    x_shape = [int(n) for n in graph.tensors[x].shape]
    if x_shape[-1] != columns:
        raise ValueError(f"FULLY_CONNECTED input {edit.name(x)} has shape {x_shape}; its filter "
                         f"{edit.name(weight)} takes {columns} features.")
    rows = int(np.prod(x_shape[:-1])) if len(x_shape) > 1 else 1
    nb = columns // BLOCK
    if x not in sums:
        blocks = edit.tensor(f"{edit.name(x)}/blocks", [rows, nb, BLOCK], s.TensorType.FLOAT32)
        edit.reshape(x, blocks, [rows, nb, BLOCK])  # (rows, in/32, 32)
        axis = edit.tensor(f"{edit.name(x)}/block_axis", [1], s.TensorType.INT32, np.array([2], np.int32))
        sums[x] = edit.tensor(f"{edit.name(x)}/block_sums", [rows, nb], s.TensorType.FLOAT32)
        options = s.ReducerOptionsT()
        options.keepDims = False
        edit.op(s.BuiltinOperator.SUM, [blocks, axis], [sums[x]], s.BuiltinOptions.ReducerOptions, options)
    output = op.outputs[0]
    out_shape = [int(n) for n in graph.tensors[output].shape]
    name = edit.name(output)
    main = edit.tensor(f"{name}/d_q", out_shape, s.TensorType.FLOAT32)
    op.outputs = [main] + list(op.outputs[1:])
    term = edit.tensor(f"{name}/m_term", [rows, rows_out], s.TensorType.FLOAT32)
    edit.op(s.BuiltinOperator.FULLY_CONNECTED, [sums[x], minimums, -1], [term],
            s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
    if out_shape != [rows, rows_out]:
        shaped = edit.tensor(f"{name}/m_term_shaped", out_shape, s.TensorType.FLOAT32)
        edit.reshape(term, shaped, out_shape)
        term = shaped
    edit.op(s.BuiltinOperator.ADD, [main, term], [output], s.BuiltinOptions.AddOptions, s.AddOptionsT())
