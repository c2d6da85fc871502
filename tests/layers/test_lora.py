"""Low-rank adapters (LoRA) in `MultiHeadAttention`: the forward pass against numpy, merging, what trains, saving."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.harness import check_layer
from tfformer.layers import MultiHeadAttention
from tfformer.layers.layer_utils import LowRankAdapters

B, T, S, D, N, K, H = 2, 5, 6, 12, 4, 2, 3
PROJECTIONS = ("query", "key", "value", "output")


def _adapter_arrays(layer):
    return {name: (getattr(layer.lora, f"{name}_lora_a").numpy(), getattr(layer.lora, f"{name}_lora_b").numpy())
            for name in PROJECTIONS}


def _randomize(layer, rng, scale=0.4):
    """Every weight random, adapters included (`B` starts at zero, which would hide a wrong update)."""
    layer.set_weights([rng.normal(size=w.shape).astype("float32") * scale for w in layer.get_weights()])


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _reference(kernels, biases, adapters, scale, query, value, causal):
    """numpy attention with grouped heads; each projection's kernel is `W + (A @ B) * scale`."""
    w = {name: kernels[name] + adapters[name][0] @ adapters[name][1] * scale for name in PROJECTIONS}
    q = (query @ w["query"] + biases["query"]).reshape(B, query.shape[1], N, H).transpose(0, 2, 1, 3)  # (B, N, T, H)
    k = (value @ w["key"] + biases["key"]).reshape(B, value.shape[1], K, H).transpose(0, 2, 1, 3)  # (B, K, S, H)
    v = (value @ w["value"] + biases["value"]).reshape(B, value.shape[1], K, H).transpose(0, 2, 1, 3)
    k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)  # each key/value head for N / K query heads
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(H)  # (B, N, T, S)
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -1e9)
    x = (_softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(B, query.shape[1], N * H)  # (B, T, N*H)
    return x @ w["output"] + biases["output"]


def _kernels_and_biases(layer):
    """Per-projection kernels and biases, the fused kernel cut into its query, key and value columns."""
    def bias(weight, units):
        return np.zeros(units, "float32") if weight is None else weight.numpy()

    if hasattr(layer, "qkv_kernel"):
        w = layer.qkv_kernel.numpy()
        cuts = np.cumsum([N * H, K * H])
        kernels = dict(zip(("query", "key", "value"), np.split(w, cuts, axis=1)))
        biases = dict(zip(("query", "key", "value"), np.split(bias(layer.qkv_bias, w.shape[1]), cuts)))
    else:
        kernels = {name: getattr(layer, f"{name}_kernel").numpy() for name in ("query", "key", "value")}
        biases = {name: bias(getattr(layer, f"{name}_bias"), kernels[name].shape[1]) for name in kernels}
    kernels["output"] = layer.output_kernel.numpy()
    biases["output"] = bias(layer.output_bias, kernels["output"].shape[1])
    return kernels, biases


def _inputs(rng, case):
    query = rng.normal(size=(B, T, D)).astype("float32")
    value = query if case == "self" else rng.normal(size=(B, S, 8)).astype("float32")  # 8 != D: separate kernels
    return query, value


@pytest.mark.parametrize("case", ["self", "cross"])
@pytest.mark.parametrize("lora_alpha", [None, 6.0])
def test_forward_matches_numpy_reference(rng, case, lora_alpha):
    query, value = _inputs(rng, case)
    layer = MultiHeadAttention(num_heads=N, key_dim=H, num_key_value_heads=K)
    layer(query, value)
    layer.enable_lora(2, lora_alpha=lora_alpha)
    _randomize(layer, rng)
    scale = (2 if lora_alpha is None else lora_alpha) / 2
    kernels, biases = _kernels_and_biases(layer)
    causal = case == "self"
    want = _reference(kernels, biases, _adapter_arrays(layer), scale, query, value, causal)
    got = layer(query, value, use_causal_mask=causal)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    # The adapters matter: without them the output is another one.
    plain = _reference(kernels, biases, {n: (a * 0, b) for n, (a, b) in _adapter_arrays(layer).items()}, scale,
                       query, value, causal)
    assert np.abs(plain - want).max() > 0.1


@pytest.mark.parametrize("case", ["self", "cross"])
def test_merged_equals_unmerged_and_leaves_a_plain_layer(rng, case):
    query, value = _inputs(rng, case)
    layer = MultiHeadAttention(num_heads=N, key_dim=H, num_key_value_heads=K)
    layer(query, value)
    layer.enable_lora(3, lora_alpha=1.5)
    _randomize(layer, rng)
    before = np.asarray(layer(query, value, use_causal_mask=case == "self"))
    kernels, _ = _kernels_and_biases(layer)
    adapters = _adapter_arrays(layer)
    layer.merge_lora()
    np.testing.assert_allclose(np.asarray(layer(query, value, use_causal_mask=case == "self")), before, atol=1e-5)
    merged, _ = _kernels_and_biases(layer)
    for name in PROJECTIONS:  # W + (A @ B) * alpha / rank, folded in
        np.testing.assert_allclose(merged[name], kernels[name] + adapters[name][0] @ adapters[name][1] * 0.5,
                                   rtol=1e-5, atol=1e-6)
    assert layer.lora_rank is None and layer.get_config()["lora_rank"] is None
    assert not layer.lora.weights and not any("lora" in w.path for w in layer.weights)
    assert len(layer.trainable_weights) == len(layer.weights)  # the kernels train again
    with pytest.raises(ValueError, match="merged into its kernels.*reload"):
        layer.enable_lora(2)


def test_only_adapters_and_biases_train_in_the_layer(rng):
    query, _ = _inputs(rng, "self")
    layer = MultiHeadAttention(num_heads=N, key_dim=H, num_key_value_heads=K)
    layer(query, query)
    layer.enable_lora(2)
    names = sorted(w.name for w in layer.trainable_weights)
    # As Keras' Dense.enable_lora: the kernels stop training, the biases do not.
    assert names == sorted(["qkv_bias", "output_bias"] + [f"{p}_lora_{x}" for p in PROJECTIONS for x in "ab"])
    assert {w.name for w in layer.non_trainable_weights} == {"qkv_kernel", "output_kernel"}
    assert all(w.path.startswith(layer.path + "/lora/") for w in layer.lora.weights)
    # Keras' initialisation: A random, B zero, so the adapted layer starts as the plain one.
    for a, b in _adapter_arrays(layer).values():
        assert np.abs(a).max() > 0 and not b.any()
    assert all(w.dtype == "float32" for w in layer.lora.weights)


def test_gradient_reaches_only_the_adapters_and_matches_numpy(rng):
    """The gradient of sum(output * dy) with respect to B_output is A^T x^T dy * scale (numpy), and the frozen
    kernels get none from the optimizer's view (they are not trainable)."""
    query, _ = _inputs(rng, "self")
    layer = MultiHeadAttention(num_heads=N, key_dim=H, num_key_value_heads=K, use_bias=False)
    layer(query, query)
    layer.enable_lora(2, lora_alpha=4.0)
    _randomize(layer, rng)
    dy = rng.normal(size=(B, T, D)).astype("float32")
    with tf.GradientTape() as tape:
        y = layer(query, query)
        loss = tf.reduce_sum(y * dy)
    grads = dict(zip([w.name for w in layer.trainable_weights],
                     tape.gradient(loss, [w.value for w in layer.trainable_weights])))
    assert set(grads) == {f"{p}_lora_{x}" for p in PROJECTIONS for x in "ab"}
    # The output projection's input: recompute the attention mix with the layer's own pieces in numpy.
    kernels, biases = _kernels_and_biases(layer)
    adapters = _adapter_arrays(layer)
    w = {name: kernels[name] + adapters[name][0] @ adapters[name][1] * 2.0 for name in PROJECTIONS}
    q = (query @ w["query"]).reshape(B, T, N, H).transpose(0, 2, 1, 3)
    k = np.repeat((query @ w["key"]).reshape(B, T, K, H).transpose(0, 2, 1, 3), N // K, axis=1)
    v = np.repeat((query @ w["value"]).reshape(B, T, K, H).transpose(0, 2, 1, 3), N // K, axis=1)
    mixed = (_softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(H)) @ v).transpose(0, 2, 1, 3).reshape(B * T, N * H)
    want = adapters["output"][0].T @ mixed.T @ dy.reshape(B * T, D) * 2.0  # (rank, D)
    np.testing.assert_allclose(np.asarray(grads["output_lora_b"]), want, rtol=1e-4, atol=1e-4)


def test_keras_round_trip_keeps_the_adapters(rng, tmp_path):
    query = rng.normal(size=(B, T, D)).astype("float32")
    inputs = keras.Input((T, D))
    layer = MultiHeadAttention(num_heads=N, key_dim=H, num_key_value_heads=K, lora_rank=2, lora_alpha=3.0)
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    _randomize(layer, rng)
    assert {w.name for w in layer.non_trainable_weights} == {"qkv_kernel", "output_kernel"}
    before = np.asarray(model(query))
    path = os.path.join(tmp_path, "lora.keras")
    model.save(path)
    reloaded = keras.models.load_model(path, safe_mode=True)
    again = next(lr for lr in reloaded.layers if isinstance(lr, MultiHeadAttention))
    assert (again.lora_rank, again.lora_alpha) == (2, 3.0)
    for name, (a, b) in _adapter_arrays(layer).items():
        np.testing.assert_array_equal(getattr(again.lora, f"{name}_lora_a").numpy(), a)
        np.testing.assert_array_equal(getattr(again.lora, f"{name}_lora_b").numpy(), b)
    assert {w.name for w in again.non_trainable_weights} == {"qkv_kernel", "output_kernel"}
    np.testing.assert_array_equal(np.asarray(reloaded(query)), before)


def test_layer_harness_with_adapters(rng):
    x = rng.normal(size=(2, 4, 8)).astype("float32")
    check_layer(MultiHeadAttention, dict(num_heads=2, key_dim=4, num_key_value_heads=1, lora_rank=2),
                {"query": x, "value": x}, expected_output_shape=(2, 4, 8))


def test_cached_steps_with_adapters_equal_one_pass(rng):
    """The cache branch projects through the same adapted kernels: token-by-token equals the full causal pass."""
    x = rng.normal(size=(1, 4, D)).astype("float32")
    layer = MultiHeadAttention(num_heads=N, key_dim=4, num_key_value_heads=K, rope_max_wavelength=100.0)
    layer(x, x)
    layer.enable_lora(2)
    _randomize(layer, rng)
    full = np.asarray(layer(x, x, use_causal_mask=True))
    cache = tf.zeros((1, 2, K, 4, 4))  # (B, 2, K, S, key_dim)
    steps = []
    for i in range(4):
        y, cache = layer(x[:, i:i + 1], x[:, i:i + 1], cache=cache, cache_index=i, use_causal_mask=True)
        steps.append(np.asarray(y))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)


def test_bad_arguments_name_themselves(rng):
    with pytest.raises(ValueError, match="lora_rank"):
        MultiHeadAttention(num_heads=2, key_dim=4, lora_rank=0)
    with pytest.raises(ValueError, match="lora_alpha"):
        MultiHeadAttention(num_heads=2, key_dim=4, lora_rank=2, lora_alpha=-1.0)
    layer = MultiHeadAttention(num_heads=2, key_dim=4)
    x = rng.normal(size=(1, 3, 8)).astype("float32")
    layer(x, x)
    with pytest.raises(ValueError, match="`rank` must be a positive integer"):
        layer.enable_lora(2.5)
    with pytest.raises(ValueError, match="no adapters to merge"):
        layer.merge_lora()
    layer.enable_lora(2)
    with pytest.raises(ValueError, match="has adapters"):
        layer.enable_lora(2)
    with pytest.raises(ValueError, match="already made its adapters"):
        layer.lora.add({"query": (8, 8)}, rank=2)


def test_adapters_layer_alone(rng):
    adapters = LowRankAdapters(name="adapters")
    adapters.add({"w": (5, 3)}, rank=2, lora_alpha=1.0, a_initializer="ones", b_initializer="ones")
    np.testing.assert_allclose(np.asarray(adapters.delta("w")), np.full((5, 3), 2.0 * 0.5))
    config = adapters.get_config()
    assert (config["rank"], config["lora_alpha"]) == (2, 1.0)
    adapters.remove()
    assert adapters.weights == [] and adapters.kernel_names == ()
