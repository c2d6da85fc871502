"""Each function returns a `matplotlib.figure.Figure`; nothing is shown or saved here.

Figures are made with `matplotlib.figure.Figure` directly (not `pyplot`), so the
library never touches the global backend or pyplot's figure list: they render
headless (`fig.savefig(...)`) and display inline in a notebook like any figure.
"""

import numpy as np
from matplotlib.figure import Figure


def _numpy(x):
    """A tensor, variable or array-like as a numpy array."""
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x)


def _heatmap(fig, ax, values, xlabel, ylabel, title, cmap="viridis", colorbar=True, **kwargs):
    image = ax.imshow(values, cmap=cmap, aspect="auto", interpolation="nearest", **kwargs)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if colorbar:
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    return image


def plot_attention(scores, source_tokens, target_tokens, title="attention", max_heads=8):
    """Attention weights as heat maps: one panel per head (rows = queries / target, columns = keys / source).

    Args:
        scores: `(T, S)`, `(N, T, S)` or `(1, N, T, S)` weights, e.g. from
            `MultiHeadAttention(..., return_attention_scores=True)`.
        source_tokens: `S` labels for the keys (columns).
        target_tokens: `T` labels for the queries (rows).
        title: the figure's title; each panel is titled with its head.
        max_heads: draw at most this many heads.
    """
    scores = _numpy(scores).astype("float32")
    if scores.ndim == 4:
        if scores.shape[0] != 1:
            raise ValueError(f"Pass the scores of one example; received a batch of {scores.shape[0]}.")
        scores = scores[0]
    if scores.ndim == 2:
        scores = scores[None]
    if scores.ndim != 3:
        raise ValueError(f"`scores` must be (T, S), (N, T, S) or (1, N, T, S). Received shape {scores.shape}.")
    heads, t, s = scores.shape
    source_tokens, target_tokens = [str(x) for x in source_tokens], [str(x) for x in target_tokens]
    if len(source_tokens) != s or len(target_tokens) != t:
        raise ValueError(
            f"scores are (T={t}, S={s}) but received {len(target_tokens)} target and "
            f"{len(source_tokens)} source tokens."
        )
    heads = min(heads, max_heads)
    columns = min(heads, 4)
    rows = -(-heads // columns)
    cell = 0.32
    width, height = max(3.5, cell * s + 1.5), max(3.0, cell * t + 1.5)
    fig = Figure(figsize=(columns * width, rows * height), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, columns, squeeze=False)).ravel()
    for head, ax in enumerate(axes):
        if head >= heads:
            ax.set_axis_off()
            continue
        _heatmap(fig, ax, scores[head], "source (keys)", "target (queries)",
                 f"head {head}" if heads > 1 else title, cmap="viridis", vmin=0.0, vmax=max(1e-6, float(scores.max())))
        ax.set_xticks(range(s), source_tokens, rotation=90, fontsize=8)
        ax.set_yticks(range(t), target_tokens, fontsize=8)
    if heads > 1:
        fig.suptitle(title)
    return fig


def plot_masks(masks, titles, row_label="query position", column_label="key position"):
    """Boolean attention masks side by side (dark = may attend, white = masked).

    Args:
        masks: a list of `(T, S)` masks (leading size-1 dimensions are dropped).
        titles: one title per mask.
    """
    masks = [_numpy(m) for m in masks]
    if len(masks) != len(titles):
        raise ValueError(f"{len(masks)} masks but {len(titles)} titles.")
    if not masks:
        raise ValueError("`masks` is empty.")
    fig = Figure(figsize=(3.6 * len(masks), 3.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(masks), squeeze=False)).ravel()
    for ax, mask, title in zip(axes, masks, titles):
        mask = np.squeeze(mask)
        if mask.ndim == 1:
            mask = mask[None]
        if mask.ndim != 2:
            raise ValueError(f"Each mask must squeeze to (T, S). Received shape {mask.shape} for {title!r}.")
        _heatmap(fig, ax, mask.astype("float32"), column_label, row_label, title, cmap="gray_r", colorbar=False,
                 vmin=0.0, vmax=1.0)
    return fig


def plot_position_encoding(encoding, title="sinusoidal position encoding"):
    """The encoding `(T, D)` as a heat map, next to its dot-product matrix `P P^T` `(T, T)`.

    The dot product of two positions depends (mostly) on their distance, which is
    why the diagonal band appears: relative offsets are linear functions of the encoding.
    """
    encoding = np.squeeze(_numpy(encoding)).astype("float32")
    if encoding.ndim != 2:
        raise ValueError(f"`encoding` must be (T, D) (or (1, T, D)). Received shape {encoding.shape}.")
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    _heatmap(fig, left, encoding, "encoding dimension", "position", title, cmap="RdBu_r", vmin=-1, vmax=1)
    _heatmap(fig, right, encoding @ encoding.T, "position", "position", "dot product between positions", cmap="viridis")
    return fig


def plot_history(history, title="training"):
    """Loss (and accuracy, if recorded) per epoch, training next to validation.

    Args:
        history: a `keras.callbacks.History` or its `.history` dict `{metric: [values]}`.
    """
    history = getattr(history, "history", history)
    if not isinstance(history, dict) or not history:
        raise ValueError("`history` must be a keras History or a non-empty {metric: [values]} dict.")
    history = {k: [float(v) for v in np.ravel(values)] for k, values in history.items()}
    first = "loss" if "loss" in history else next((k for k in history if not k.startswith("val_")), next(iter(history)))
    groups = [(first, first)]
    accuracy = next((k for k in history if not k.startswith("val_") and "acc" in k), None)
    if accuracy:
        groups.append((accuracy, "accuracy"))
    fig = Figure(figsize=(5.5 * len(groups), 4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(groups), squeeze=False)).ravel()
    for ax, (key, label) in zip(axes, groups):
        for name, style in ((key, "-o"), (f"val_{key}", "--s")):
            if name in history:
                values = history[name]
                ax.plot(range(1, len(values) + 1), values, style, markersize=3,
                        label="validation" if name.startswith("val_") else "training")
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.set_title(f"{title}: {label}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    return fig
