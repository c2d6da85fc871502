"""Every plot renders to a real PNG with labelled, titled axes."""

import io

import keras
import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread

from tfformer import layers, viz
from tfformer.layers import masks


def _png(fig, tmp_path, name):
    path = tmp_path / f"{name}.png"
    fig.savefig(path, dpi=60)
    assert path.stat().st_size > 1000, "the PNG is (nearly) empty"
    pixels = imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 50 and pixels.shape[1] > 50
    assert float(np.var(pixels[..., :3])) > 1e-3, "the image is blank"
    return pixels


def _check_axes(fig, expected_axes):
    assert isinstance(fig, Figure)
    # Colorbars are axes too; the plotting axes are the ones with an image or a line.
    axes = [ax for ax in fig.axes if (ax.images or ax.lines) and ax.get_label() != "<colorbar>"]
    assert len(axes) == expected_axes
    for ax in axes:
        assert ax.get_xlabel(), "x axis has no label"
        assert ax.get_ylabel(), "y axis has no label"
        assert ax.get_title(), "axes have no title"


def _scores():
    attention = layers.MultiHeadAttention(num_heads=2, key_dim=4)
    query = np.random.default_rng(0).normal(size=(1, 3, 8)).astype("float32")
    value = np.random.default_rng(1).normal(size=(1, 5, 8)).astype("float32")
    _, scores = attention(query, value, return_attention_scores=True)
    return scores  # (1, 2, 3, 5)


def test_plot_attention(tmp_path):
    fig = viz.plot_attention(_scores(), ["a", "b", "c", "d", "e"], ["x", "y", "z"], title="cross-attention")
    _check_axes(fig, 2)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c", "d", "e"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["x", "y", "z"]
    _png(fig, tmp_path, "attention")


def test_plot_attention_single_head_and_errors(tmp_path):
    fig = viz.plot_attention(np.eye(3), list("abc"), list("abc"), title="identity")
    _check_axes(fig, 1)
    _png(fig, tmp_path, "attention_one_head")
    with pytest.raises(ValueError, match="source tokens"):
        viz.plot_attention(np.eye(3), list("ab"), list("abc"))


def test_plot_masks(tmp_path):
    token_ids = np.array([[5, 7, 9, 0, 0, 0]])
    causal = masks.causal_mask(6)
    padding = masks.key_mask(masks.padding_mask(token_ids))
    both = masks.merge_masks(causal, padding)
    fig = viz.plot_masks([causal, np.broadcast_to(keras.ops.convert_to_numpy(padding), (1, 6, 6)), both],
                         ["causal", "padding", "causal & padding"])
    _check_axes(fig, 3)
    assert [ax.get_title() for ax in fig.axes] == ["causal", "padding", "causal & padding"]
    _png(fig, tmp_path, "masks")
    with pytest.raises(ValueError, match="titles"):
        viz.plot_masks([causal], ["a", "b"])


def test_plot_position_encoding(tmp_path):
    encoding = layers.SinusoidalPositionEncoding()(np.zeros((1, 40, 32), "float32"))
    fig = viz.plot_position_encoding(encoding)
    _check_axes(fig, 2)
    _png(fig, tmp_path, "position")


def test_plot_history_dict_and_keras_history(tmp_path):
    history = {"loss": [2.0, 1.5, 1.2], "val_loss": [2.1, 1.7, 1.6],
               "masked_accuracy": [0.2, 0.4, 0.5], "val_masked_accuracy": [0.2, 0.35, 0.45]}
    fig = viz.plot_history(history)
    _check_axes(fig, 2)
    assert all(len(ax.lines) == 2 for ax in fig.axes if ax.lines)
    _png(fig, tmp_path, "history")

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    keras_history = model.fit(np.ones((8, 3)), np.ones((8, 1)), epochs=2, verbose=0)
    fig = viz.plot_history(keras_history)
    _check_axes(fig, 1)
    _png(fig, tmp_path, "keras_history")


def test_no_pyplot_state():
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    viz.plot_history({"loss": [1.0, 0.5]})
    assert plt.get_fignums() == before  # the library never registers figures with pyplot


def test_figure_renders_to_buffer():
    buffer = io.BytesIO()
    viz.plot_position_encoding(np.random.default_rng(0).normal(size=(10, 8))).savefig(buffer, format="png")
    assert buffer.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"
