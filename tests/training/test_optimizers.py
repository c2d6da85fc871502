import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.training.adam import assert_adam_weights_close
from tfformer import models, training


def _lm():
    config = models.TransformerConfig(architecture="causal_lm", vocabulary_size=40, hidden_dim=16, num_heads=2,
                                      intermediate_dim=32, num_encoder_layers=0, num_decoder_layers=1, dropout=0.0,
                                      max_sequence_length=12, position="learned")
    return models.build_causal_lm(config)


def _train(optimizer, steps=4):
    """`steps` updates of a tiny LM from fixed weights and data (tied embeddings: every gradient is dense)."""
    keras.utils.set_random_seed(0)
    model = _lm()
    rng = np.random.default_rng(0)
    x = rng.integers(1, 40, size=(6, 10)).astype("int32")
    y = rng.integers(1, 40, size=(6, 10)).astype("int32")
    y[:, 7:] = 0
    model.compile(optimizer=optimizer, loss=training.MaskedSparseCrossEntropy(0.1), jit_compile=False)
    start = [w.copy() for w in model.get_weights()]
    model.fit({"token_ids": x}, y, batch_size=3, epochs=steps // 2, shuffle=False, verbose=0)
    return start, model


KERAS_AND_FUSED = [
    (lambda: keras.optimizers.Adam(3e-3), lambda: training.FusedAdam(3e-3)),
    (lambda: keras.optimizers.Adam(3e-3, beta_2=0.98, epsilon=1e-9, clipnorm=0.5),
     lambda: training.FusedAdam(3e-3, beta_2=0.98, epsilon=1e-9, clipnorm=0.5)),
    (lambda: keras.optimizers.AdamW(training.WarmupCosine(3e-3, 2, 10), weight_decay=0.0),
     lambda: training.FusedAdamW(training.WarmupCosine(3e-3, 2, 10), weight_decay=0.0)),
    (lambda: keras.optimizers.AdamW(3e-3, weight_decay=0.05), lambda: training.FusedAdamW(3e-3, weight_decay=0.05)),
    (lambda: keras.optimizers.Adam(3e-3, amsgrad=True), lambda: training.FusedAdam(3e-3, amsgrad=True)),
]


@pytest.mark.parametrize("make_keras,make_fused", KERAS_AND_FUSED)
def test_fused_adam_trains_like_keras_adam(make_keras, make_fused):
    start, ours = _train(make_fused())
    start_theirs, theirs = _train(make_keras())
    for a, b in zip(start, start_theirs):
        np.testing.assert_array_equal(a, b)
    assert any(not np.allclose(s, w) for s, w in zip(start, ours.get_weights())), "training did not move the weights"
    for w, a, b in zip(ours.weights, ours.get_weights(), theirs.get_weights()):
        # 4 steps of lr 3e-3
        assert_adam_weights_close(w.path, a, b, hidden_dim=16, max_drift=4 * 3e-3, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours.optimizer.variables, theirs.optimizer.variables):  # iterations, moments, velocities
        assert a.path.split("/")[-1] == b.path.split("/")[-1]
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("make,amsgrad", [(lambda: training.FusedAdam(0.1), False),
                                          (lambda: training.FusedAdamW(0.1, weight_decay=0.0), False),
                                          (lambda: training.FusedAdam(0.1, amsgrad=True), True)])
def test_sparse_gradient_with_repeated_rows_is_summed_first(make, amsgrad):
    """An embedding lookup's gradient (IndexedSlices) repeats a row per occurrence of its id. Adam is not linear
    in the gradient: the update must be that of the summed (dense) gradient. Keras' own Adam squares each repeat
    before adding them (its second moment of row 0 here is (1 + 4 and 1 + 9) instead of 9 and 4), so it is only
    compared on dense gradients above."""
    sparse = tf.IndexedSlices(tf.constant([[1.0, 1.0], [2.0, -3.0]]), tf.constant([0, 0]), tf.constant([4, 2]))
    dense = tf.convert_to_tensor(sparse)  # row 0: (3, -2)
    results = []
    for optimizer, gradient in ((make(), sparse), (keras.optimizers.Adam(0.1, amsgrad=amsgrad), dense)):
        variable = keras.Variable(np.ones((4, 2), "float32"))
        optimizer.build([variable])
        step = tf.function(lambda: optimizer.apply_gradients([(gradient, variable)]))
        for _ in range(2):
            step()
        results.append(variable.numpy())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5)
    np.testing.assert_allclose(results[0][0], [0.8, 1.2], rtol=1e-5)  # two steps of lr * sign(g) (m_hat/sqrt(v_hat))
    np.testing.assert_array_equal(results[0][1:], 1.0)


def test_fused_adam_runs_one_kernel_per_variable():
    variables = [keras.Variable(np.ones((3, 4), "float32")), keras.Variable(np.ones((4,), "float32"))]
    optimizer = training.FusedAdamW(1e-3, weight_decay=0.0)
    optimizer.build(variables)
    grads = [tf.ones((3, 4)), tf.ones((4,))]
    graph = tf.function(lambda: optimizer.apply_gradients(zip(grads, variables))).get_concrete_function().graph
    types = [op.type for op in graph.get_operations()]
    assert types.count("ResourceApplyAdam") == 2
    assert "Sqrt" not in types  # Keras' own update is not traced as well
    assert "Mul" not in types and "AssignSubVariableOp" not in types  # a weight decay of 0 builds no decay


def test_nonzero_weight_decay_is_keras_decay():
    """The check above can fail: a decay of 0.05 builds Keras' `variable -= variable * wd * lr` per variable."""
    variables = [keras.Variable(np.ones((3, 4), "float32")), keras.Variable(np.ones((4,), "float32"))]
    optimizer = training.FusedAdamW(1e-3, weight_decay=0.05)
    optimizer.build(variables)
    grads = [tf.ones((3, 4)), tf.ones((4,))]
    graph = tf.function(lambda: optimizer.apply_gradients(zip(grads, variables))).get_concrete_function().graph
    assert [op.type for op in graph.get_operations()].count("AssignSubVariableOp") == 2


def test_transformer_optimizer_is_fused_and_round_trips(tmp_path):
    optimizer = training.transformer_optimizer(hidden_dim=16, warmup_steps=10, clipnorm=1.0)
    assert isinstance(optimizer, training.FusedAdamW)
    _, model = _train(optimizer, steps=2)
    path = tmp_path / "lm.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert type(loaded.optimizer) is training.FusedAdamW
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
