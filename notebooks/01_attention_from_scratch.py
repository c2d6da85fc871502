# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Attention from scratch
#
# "An attention function can be described as mapping a query and a set of key-value pairs to an output,
# where the query, keys, values, and output are all vectors" (Vaswani et al., 2017, §3.2). This notebook
# builds the paper's attention step by step in numpy, next to tfformer's own `MultiHeadAttention`, and
# draws every mask and the position encoding so each one can be checked by eye.
#
# Runs in seconds on a CPU; `TFFORMER_QUICK=1` changes nothing here but is accepted like in every notebook.

# %%
# %matplotlib inline
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
QUICK = os.environ.get("TFFORMER_QUICK") == "1"

import keras  # noqa: E402
import numpy as np  # noqa: E402
from IPython.display import display  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from tfformer import layers, viz  # noqa: E402
from tfformer.layers import masks  # noqa: E402

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. Scaled dot-product attention
#
# $$\mathrm{Attention}(Q, K, V) = \mathrm{softmax}\!\left(\frac{QK^\top}{\sqrt{d_k}}\right) V$$
#
# The $1/\sqrt{d_k}$ keeps the dot products from growing with $d_k$: for unit-variance $q, k$ the dot
# product has variance $d_k$, which would push the softmax into regions with tiny gradients.

# %%
def softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def attention(q, k, v, mask=None):
    """q (T, d), k (S, d), v (S, dv), mask (T, S) bool True = may attend -> (T, dv), weights (T, S)."""
    scores = q @ k.T / np.sqrt(q.shape[-1])  # (T, S)
    if mask is not None:
        scores = np.where(mask, scores, -1e9)
    weights = softmax(scores)
    return weights @ v, weights


T, S, d = 4, 6, 8
q, k, v = rng.normal(size=(T, d)), rng.normal(size=(S, d)), rng.normal(size=(S, d))
out, weights = attention(q, k, v)
print("output", out.shape, "weights", weights.shape, "rows sum to", weights.sum(-1).round(6))

# The variance argument, measured:
for dk in (4, 64, 1024):
    a, b = rng.normal(size=(10000, dk)), rng.normal(size=(10000, dk))
    products = (a * b).sum(-1)
    print(f"d_k={dk:5d}: var(q.k)={np.var(products):8.1f}  var(q.k/sqrt(d_k))={np.var(products / np.sqrt(dk)):.2f}")

# %% [markdown]
# ## 2. Multi-head attention, numpy next to `tfformer.layers.MultiHeadAttention`
#
# $$\mathrm{MultiHead}(Q,K,V) = \mathrm{Concat}(\mathrm{head}_1,\dots,\mathrm{head}_h)W^O,\quad
# \mathrm{head}_i = \mathrm{Attention}(QW_i^Q, KW_i^K, VW_i^V)$$
#
# Our layer keeps the three input projections in one fused kernel `qkv_kernel` `(D, 3·N·H)` (one matmul
# for self-attention). We take its weights and redo the computation in numpy, head by head.

# %%
D, N, H = 16, 4, 4  # model width, heads, head size
x = rng.normal(size=(1, 5, D)).astype("float32")  # (B=1, T=5, D)
mha = layers.MultiHeadAttention(num_heads=N, key_dim=H)
y, scores = mha(x, x, return_attention_scores=True)
print("layer output", tuple(y.shape), "attention weights", tuple(scores.shape), "= (B, N, T, S)")

W, b = mha.qkv_kernel.numpy(), mha.qkv_bias.numpy()
Wo, bo = mha.output_kernel.numpy(), mha.output_bias.numpy()
qkv = x[0] @ W + b  # (T, 3*N*H): [queries | keys | values]
Q, K, V = np.split(qkv, 3, axis=-1)  # each (T, N*H)
heads, numpy_weights = [], []
for i in range(N):
    cols = slice(i * H, (i + 1) * H)
    head, w = attention(Q[:, cols], K[:, cols], V[:, cols])
    heads.append(head)
    numpy_weights.append(w)
numpy_y = np.concatenate(heads, axis=-1) @ Wo + bo  # (T, D)

print("max |layer - numpy| output :", np.abs(y.numpy()[0] - numpy_y).max())
print("max |layer - numpy| weights:", np.abs(scores.numpy()[0] - np.stack(numpy_weights)).max())

# %%
tokens = ["the", "cat", "sat", "down", "."]
display(viz.plot_attention(scores, tokens, tokens, title="self-attention, 4 heads (random weights)"))

# %% [markdown]
# ## 3. Masks
#
# tfformer masks are boolean and `True` means *may attend*. The decoder's **causal** mask stops position $i$
# from seeing positions $> i$ (so training with the whole target at once cannot peek at the future); the
# **padding** mask hides padding keys (id 0). Merged, they are ANDed. Black = may attend.

# %%
token_ids = np.array([[12, 7, 93, 4, 0, 0]])  # 4 real tokens, 2 padding
L = token_ids.shape[1]
causal = masks.causal_mask(L)  # (1, T, S)
padding = masks.key_mask(masks.padding_mask(token_ids))  # (B, 1, S)
padding_square = np.broadcast_to(keras.ops.convert_to_numpy(padding), (1, L, L))
both = masks.merge_masks(causal, padding)  # (B, T, S)
display(viz.plot_masks([causal, padding_square, both], ["causal", "padding (keys)", "causal AND padding"]))

# %% [markdown]
# The masked softmax gives exactly zero weight to masked keys. Attention with the causal mask: the weights
# are lower-triangular, so the output at position $t$ does not change when later tokens change.

# %%
x = rng.normal(size=(1, L, D)).astype("float32")
y_causal, w_causal = mha(x, x, use_causal_mask=True, return_attention_scores=True)
x_changed = x.copy()
x_changed[:, 3:] += 5.0  # change the future of positions 0..2
y_changed = mha(x_changed, x_changed, use_causal_mask=True)
print("upper triangle of the weights:", np.triu(w_causal.numpy()[0, 0], k=1).max())
print("positions 0..2 unchanged when 3.. change:", np.allclose(y_causal[:, :3], y_changed[:, :3], atol=1e-6))
display(viz.plot_attention(w_causal[:, :1], list("abcdef"), list("abcdef"), title="causal self-attention (head 0)"))

# %% [markdown]
# ## 4. Sinusoidal position encoding
#
# $$PE_{(pos,2i)} = \sin(pos/10000^{2i/d}),\quad PE_{(pos,2i+1)} = \cos(pos/10000^{2i/d})$$
#
# Attention is permutation-invariant, so order enters through these encodings. Left: the encoding (each
# column is a sinusoid, wavelengths from $2\pi$ to $10000\cdot2\pi$). Right: $PE\,PE^\top$; the dot product of two
# positions depends on their *distance* only (a band along the diagonal), "since for any fixed offset $k$,
# $PE_{pos+k}$ can be represented as a linear function of $PE_{pos}$".

# %%
pe = layers.SinusoidalPositionEncoding()(np.zeros((1, 100, 64), "float32"))[0].numpy()  # (100, 64)
display(viz.plot_position_encoding(pe))
dots = pe @ pe.T
print("dot product at distance 5 along the diagonal: min", np.diag(dots, 5).min().round(4),
      "max", np.diag(dots, 5).max().round(4))

# %% [markdown]
# ## 5. Four score functions
#
# `MultiHeadAttention(score=...)` offers the score functions of the original papers:
#
# | `score` | $\mathrm{score}(q, k)$ | from |
# |---|---|---|
# | `scaled_dot` | $q^\top k/\sqrt{d_k}$ | Vaswani et al. 2017 |
# | `dot` | $q^\top k$ | Luong et al. 2015 |
# | `general` | $q^\top W k$ | Luong et al. 2015 |
# | `additive` | $w^\top \tanh(q + k)$ | Bahdanau et al. 2015 |
#
# Same input, same projection initialisation (same seed), four layers: the weights of head 0.

# %%
x = rng.normal(size=(1, 6, D)).astype("float32")
score_names = ["scaled_dot", "dot", "general", "additive"]
score_weights = {}
for name in score_names:
    keras.utils.set_random_seed(1)
    layer = layers.MultiHeadAttention(num_heads=2, key_dim=8, score=name)
    _, w = layer(x, x, use_causal_mask=True, return_attention_scores=True)
    score_weights[name] = w.numpy()[0, 0]

fig = Figure(figsize=(14, 3.6), layout="constrained")
for ax, name in zip(fig.subplots(1, 4), score_names):
    image = ax.imshow(score_weights[name], vmin=0, vmax=1, cmap="viridis")
    ax.set_title(f"score={name!r}")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
fig.colorbar(image, ax=fig.axes, fraction=0.02)
display(fig)
for name in score_names:
    w = score_weights[name]
    print(f"{name:10s} row sums {w.sum(-1).round(4)}  mean largest weight (rows 1..) {w[1:].max(-1).mean():.3f}")

# %% [markdown]
# `dot` is `scaled_dot` without the $1/\sqrt{d_k}$: with identical projections its weights are the same
# scores made sharper (multiplied by $\sqrt{8}$ before the softmax).

# %% [markdown]
# ## Check: what this notebook teaches

# %%
assert np.allclose(y.numpy()[0], numpy_y, atol=1e-5), "numpy multi-head attention != the layer"
assert np.allclose(scores.numpy()[0], np.stack(numpy_weights), atol=1e-5)
assert np.triu(w_causal.numpy()[0], k=1).max() == 0.0, "the causal mask leaks the future"
assert np.allclose(y_causal[:, :3], y_changed[:, :3], atol=1e-5)
assert np.allclose(keras.ops.convert_to_numpy(both)[0], np.tril(np.ones((L, L), bool)) & (token_ids[0] != 0)[None, :])
assert np.ptp(np.diag(dots, 5)) < 1e-3, "PE dot products should depend on the distance only"
for name in score_names:
    assert np.allclose(score_weights[name].sum(-1), 1.0, atol=1e-5)
    assert np.triu(score_weights[name], k=1).max() == 0.0
# Scaling the scores up sharpens every softmax row: `dot` is never flatter than `scaled_dot`.
assert np.all(score_weights["dot"].max(-1) >= score_weights["scaled_dot"].max(-1) - 1e-6)
print("all checks passed")
