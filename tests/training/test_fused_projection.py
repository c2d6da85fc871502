"""Training with the output projection fused with the loss (`TransformerModel.train_step`) against the unfused step.

The unfused reference is the same model compiled with `MaskedSparseCrossEntropy(fuse_projection=False)`: Keras'
own train_step on the model's logits. Same initial weights and seeds, dropout on, label smoothing, padding.
"""

import keras
import numpy as np
import pytest

from tfformer import models, training

LOSS = training.MaskedSparseCrossEntropy


def _config(architecture, **overrides):
    config = dict(vocabulary_size=40, hidden_dim=16, num_heads=2, intermediate_dim=32, dropout=0.1,
                  max_sequence_length=16)
    if architecture == "causal_lm":
        config.update(architecture="causal_lm", num_encoder_layers=0, num_decoder_layers=2)
    else:
        config.update(num_encoder_layers=1, num_decoder_layers=1)
    config.update(overrides)
    return models.TransformerConfig(**config)


def _batch(architecture, rng):
    """3 x 7 target tokens (not a power of two: the per-token upstream is rounded) with padding."""
    ids = rng.integers(1, 40, size=(3, 8)).astype("int32")
    ids[0, 5:] = 0
    ids[2, 3:] = 0
    if architecture == "causal_lm":
        return {"token_ids": ids[:, :-1]}, ids[:, 1:]
    source = rng.integers(1, 40, size=(3, 6)).astype("int32")
    source[1, 4:] = 0
    return {"encoder_token_ids": source, "decoder_token_ids": ids[:, :-1]}, ids[:, 1:]


def _train(config, loss, data, steps=3, metrics=True, jit_compile=False, micro_batches=1, **fit_kwargs):
    """`metrics`: True for tfformer's two metrics, False for none, or a list."""
    keras.utils.set_random_seed(7)  # same initial weights and dropout seeds for every model
    model = models.build_model(config)
    if metrics is True:
        metrics = [training.MaskedAccuracy(), training.Perplexity()]
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss, jit_compile=jit_compile, metrics=metrics or None,
                  micro_batches=micro_batches)
    logs = [model.train_on_batch(*data, return_dict=True, **fit_kwargs) for _ in range(steps)]
    return model, logs


@pytest.fixture
def spy(monkeypatch):
    """Counts the loss's unfused (`call`) and fused (`call_on_hidden_states`) uses while a step is traced;
    `outputs` lists what each fused use returned for the metrics: "logits", "statistics" or "none"."""
    counts = {"call": 0, "call_on_hidden_states": 0}
    outputs = []
    for name in counts:
        original = getattr(LOSS, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            if _name == "call_on_hidden_states":
                outputs.append("logits" if kwargs.get("return_logits") else
                               "statistics" if kwargs.get("return_statistics") else "none")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(LOSS, name, counted)
    counts["outputs"] = outputs
    return counts


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("architecture", ["causal_lm", "seq2seq"])
def test_fused_training_equals_unfused(rng, spy, architecture, policy):
    keras.config.set_dtype_policy(policy)
    config, data = _config(architecture), _batch(architecture, rng)
    # bfloat16: one step (later steps would compare two trajectories that rounding has moved apart).
    steps = 3 if policy == "float32" else 1
    fused, fused_logs = _train(config, LOSS(0.1), data, steps=steps)
    assert spy["call"] == 0 and spy["call_on_hidden_states"] > 0, spy  # fused
    assert set(spy["outputs"]) == {"statistics"}, spy  # the metrics read per-token statistics, no logits
    plain, plain_logs = _train(config, LOSS(0.1, fuse_projection=False), data, steps=steps)
    assert spy["call"] > 0, spy
    start, _ = _train(config, LOSS(0.1), data, steps=0)
    moved = [np.abs(a - b).max() for a, b in zip(plain.get_weights(), start.get_weights())]
    assert np.median(moved) > 1e-3, "SGD steps move the weights"
    # Plain SGD, so that weight differences are gradient differences (Adam would blow rounding noise in the
    # key bias, whose true gradient is 0, up to lr-sized steps). float32: the same arithmetic up to summation
    # order. bfloat16: the two steps round the logits' gradient to bfloat16 at different points (before vs
    # after the 1/21 upstream factor): within a few bfloat16 ulps (2^-8) of each weight's movement.
    for a, b, c in zip(fused.get_weights(), plain.get_weights(), start.get_weights()):
        scale = np.abs(b - c).max()
        np.testing.assert_allclose(a, b, atol=1e-6 + scale * (1e-5 if policy == "float32" else 2**-5))
    for ours, theirs in zip(fused_logs, plain_logs):
        assert ours.keys() == theirs.keys() == {"loss", "masked_accuracy", "perplexity"}
        for key in ours:
            np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5 if policy == "float32" else 1e-2)


def test_fused_training_without_metrics_and_under_xla(rng, spy):
    """No compiled metrics: the fused step makes no logits at all. jit_compile=True: the same step in XLA."""
    config, data = _config("causal_lm"), _batch("causal_lm", rng)
    plain, plain_logs = _train(config, LOSS(0.1, fuse_projection=False), data, metrics=False)
    for jit_compile in (False, True):
        fused, logs = _train(config, LOSS(0.1), data, metrics=False, jit_compile=jit_compile)
        for a, b in zip(fused.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(a, b, atol=2e-6)
        np.testing.assert_allclose([x["loss"] for x in logs], [x["loss"] for x in plain_logs], rtol=1e-5)
    assert spy["call_on_hidden_states"] > 0 and set(spy["outputs"]) == {"none"}, spy


@pytest.mark.parametrize("fuse_projection", [True, False])
def test_out_of_range_label_under_xla_is_a_nan_loss_not_a_clamped_one(rng, fuse_projection):
    """Under jit_compile=True XLA drops the label checks and would clamp a bad id to the last class. Instead the
    step reports a NaN loss, and that token's gradient is zero: the weights move as if it were padding."""
    config, (x, y) = _config("causal_lm"), _batch("causal_lm", rng)
    bad, padded = y.copy(), y.copy()
    bad[1, 2], padded[1, 2] = 40, 0  # vocabulary_size 40
    model, logs = _train(config, LOSS(0.1, fuse_projection=fuse_projection), (x, bad), steps=1, jit_compile=True)
    reference, reference_logs = _train(config, LOSS(0.1, fuse_projection=fuse_projection), (x, padded), steps=1,
                                       jit_compile=True)
    assert np.isnan(logs[0]["loss"]) and np.isfinite(reference_logs[0]["loss"]), (logs, reference_logs)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("metrics", ["statistics", "logits"])
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("architecture", ["causal_lm", "seq2seq"])
def test_micro_batches_train_as_the_whole_batch(rng, spy, architecture, policy, metrics):
    """`compile(micro_batches=k)`: k projections + losses per step, and the weights and logs of the unfused
    step on the whole batch. k = 2 cuts the 3 examples into 1 + 2, k = 4 leaves one part empty; float32 also
    k = 2 under XLA. No dropout (each part draws its own masks)."""
    keras.config.set_dtype_policy(policy)
    config, data = _config(architecture, dropout=0.0), _batch(architecture, rng)
    steps = 3 if policy == "float32" else 1

    def compiled_metrics():
        extra = [keras.metrics.SparseCategoricalAccuracy()] if metrics == "logits" else []
        return [training.MaskedAccuracy(), training.Perplexity()] + extra

    plain, plain_logs = _train(config, LOSS(0.1, fuse_projection=False), data, steps=steps, metrics=compiled_metrics())
    start, _ = _train(config, LOSS(0.1), data, steps=0)
    runs = [(2, False), (4, False)] + ([(2, True)] if policy == "float32" else [])
    for micro_batches, jit_compile in runs:
        spy.update(call=0, call_on_hidden_states=0)
        del spy["outputs"][:]
        model, logs = _train(config, LOSS(0.1), data, steps=steps, metrics=compiled_metrics(),
                             micro_batches=micro_batches, jit_compile=jit_compile)
        assert spy["call"] == 0 and spy["call_on_hidden_states"] == micro_batches, spy  # one trace, k parts
        assert set(spy["outputs"]) == {metrics}, spy
        for a, b, c in zip(model.get_weights(), plain.get_weights(), start.get_weights()):
            scale = np.abs(b - c).max()
            np.testing.assert_allclose(a, b, atol=1e-6 + scale * (1e-5 if policy == "float32" else 2**-5))
        for ours, theirs in zip(logs, plain_logs):
            assert ours.keys() == theirs.keys()
            for key in ours:
                np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5 if policy == "float32" else 1e-2)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("architecture", ["causal_lm", "seq2seq"])
def test_micro_batches_evaluate_as_the_whole_batch(rng, monkeypatch, architecture, policy):
    """`evaluate` of a model compiled with `micro_batches=k` runs the forward pass once per part (k = 2: 1 + 2
    examples, k = 4: one part empty) and reports the loss and metrics of the whole batch, padding included;
    prediction does not cut."""
    from keras.src.models import functional

    keras.config.set_dtype_policy(policy)
    config, (x, y) = _config(architecture), _batch(architecture, rng)
    calls = []
    original = functional.Functional.call
    monkeypatch.setattr(functional.Functional, "call", lambda self, inputs, *a, **k: (
        calls.append(keras.tree.flatten(inputs)[0].shape[0]), original(self, inputs, *a, **k))[1])
    results = {}
    for micro_batches in (1, 2, 4):
        keras.utils.set_random_seed(7)
        model = models.build_model(config)
        model.compile(optimizer="sgd", loss=LOSS(0.1), micro_batches=micro_batches,
                      metrics=[training.MaskedAccuracy(), training.Perplexity(),
                               keras.metrics.SparseCategoricalAccuracy()])
        del calls[:]
        results[micro_batches] = model.evaluate(x, y, batch_size=3, verbose=0, return_dict=True)
        assert calls == ([3] if micro_batches == 1 else [1, 2] if micro_batches == 2 else [0, 1, 1, 1]), calls
        del calls[:]
        model.predict(x, batch_size=3, verbose=0)
        assert calls == [3], calls
    assert results[1]["loss"] > 0
    for micro_batches in (2, 4):
        assert results[micro_batches].keys() == results[1].keys()
        for key, value in results[1].items():
            np.testing.assert_allclose(results[micro_batches][key], value, rtol=1e-6 if policy == "float32" else 1e-2)


@pytest.mark.parametrize("micro_batches", [0, -1, 2.0, True, "2", None])
def test_micro_batches_must_be_a_positive_int(micro_batches):
    model = models.build_model(_config("causal_lm"))
    with pytest.raises(ValueError, match=r"`micro_batches` must be an int >= 1. Received: micro_batches="):
        model.compile(optimizer="sgd", loss=LOSS(0.1), micro_batches=micro_batches)


class _ArgmaxOfHalfLogits(training.MaskedAccuracy):
    """A metric subclass that changed `update_state`: it gets the logits, not statistics."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(y_true, 0.5 * y_pred, sample_weight=sample_weight)


@pytest.mark.parametrize("other", ["keras", "subclass"])
def test_metrics_that_need_logits_get_them(rng, spy, other):
    """Any compiled metric that does not take statistics (a Keras metric, a subclass that changed update_state):
    the fused step hands every metric the float32 logits, and the logs equal the unfused step's."""
    config, data = _config("causal_lm"), _batch("causal_lm", rng)

    def metrics():
        extra = keras.metrics.SparseCategoricalAccuracy() if other == "keras" else _ArgmaxOfHalfLogits(name="half")
        return [training.MaskedAccuracy(), training.Perplexity(), extra]

    fused, fused_logs = _train(config, LOSS(0.1), data, steps=2, metrics=metrics())
    assert spy["call"] == 0 and set(spy["outputs"]) == {"logits"}, spy
    plain, plain_logs = _train(config, LOSS(0.1, fuse_projection=False), data, steps=2, metrics=metrics())
    for ours, theirs in zip(fused_logs, plain_logs):
        assert ours.keys() == theirs.keys() and len(ours) == 4, ours
        for key in ours:
            np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5)


class _DoubledLoss(LOSS):
    """A subclass that changes `call` but not `call_on_hidden_states`: fusing would drop its change."""

    def call(self, y_true, y_pred):
        return 2.0 * super().call(y_true, y_pred)


class _CappedLM(models.CausalLM):
    """A model subclass that post-processes the logits in `call`: fusing would skip it."""

    def call(self, inputs, training=None, mask=None):
        return 0.5 * super().call(inputs, training=training, mask=mask)


def _float16_step(data):
    keras.config.set_dtype_policy("mixed_float16")  # loss scaling needs the logits' gradient in float32
    try:
        _train(_config("causal_lm"), LOSS(0.1), data)
    finally:
        keras.config.set_dtype_policy("float32")


def test_steps_that_cannot_fuse_train_as_before(rng, spy):
    """Sample weights, an untied output projection, loss_weights, a loss or model subclass that changed `call`,
    a float64 loss, or float16: Keras' own step on the logits."""
    data = _batch("causal_lm", rng)
    weights = np.repeat(np.array([[1.0], [0.5], [2.0]], "float32"), 7, axis=1)  # per token
    keras.utils.set_random_seed(7)
    weighted = models.build_model(_config("causal_lm"))
    weighted.compile(optimizer="sgd", loss=LOSS(0.1), loss_weights=2.0)
    capped = _CappedLM(_config("causal_lm"), name="capped_lm")
    capped.compile(optimizer="sgd", loss=LOSS(0.1))
    steps = [
        lambda: _train(_config("causal_lm"), LOSS(0.1), data, sample_weight=weights),
        lambda: _train(_config("causal_lm", tie_embeddings=False), LOSS(0.1), data),
        lambda: weighted.train_on_batch(*data),
        lambda: capped.train_on_batch(*data),
        lambda: _train(_config("causal_lm"), LOSS(0.1, dtype="float64"), data, metrics=False),
        lambda: _float16_step(data),
    ]
    for step in steps:
        spy.update(call=0, call_on_hidden_states=0)
        step()
        assert spy["call"] > 0 and spy["call_on_hidden_states"] == 0, spy
    # The loss subclass reaches `call` through super(); its doubled loss is what fit reports.
    plain, plain_logs = _train(_config("causal_lm"), LOSS(0.1, fuse_projection=False), data, steps=1, metrics=False)
    doubled, doubled_logs = _train(_config("causal_lm"), _DoubledLoss(0.1), data, steps=1, metrics=False)
    np.testing.assert_allclose(doubled_logs[0]["loss"], 2 * plain_logs[0]["loss"], rtol=1e-5)


def test_fused_model_round_trips_through_keras_file(rng, tmp_path, spy):
    """A model trained fused saves and loads compiled (safe_mode), evaluates alike, and trains fused again, in
    as many micro-batches as it was compiled with."""
    config, data = _config("seq2seq"), _batch("seq2seq", rng)
    model, _ = _train(config, LOSS(0.1), data, steps=1, micro_batches=2)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert loaded.loss.fuse_projection is True and loaded.micro_batches == 2
    np.testing.assert_allclose(loaded.evaluate(*data, verbose=0, return_dict=True)["loss"],
                               model.evaluate(*data, verbose=0, return_dict=True)["loss"], rtol=1e-6)
    spy.update(call=0, call_on_hidden_states=0)
    loaded.train_on_batch(*data)
    assert spy["call"] == 0 and spy["call_on_hidden_states"] == 2, spy
