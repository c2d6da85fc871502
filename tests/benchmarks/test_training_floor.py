"""The training benchmark's matmul floor: the same FLOPs as the stated formula, and the matmuls the step runs."""

import numpy as np
import pytest
import tensorflow as tf

from benchmarks import training


@pytest.mark.parametrize("workload", ["seq2seq", "lm"])
def test_floor_matmuls_have_the_flops_of_the_formula(workload):
    # Full-size shapes; the formula counts the models' own parameters (biases and LayerNorms too: < 0.5%).
    s = training._seq2seq_shape(False) if workload == "seq2seq" else training._lm_shape(False)
    model = training.tfformer_seq2seq(s) if workload == "seq2seq" else training.tfformer_lm(s)
    tokens = s["batch"] * s["length"]
    attention_layers = 3 * s["layers"] if workload == "seq2seq" else s["layers"]
    formula = training._flops(s, attention_layers, training._dense_params(model, s["vocab"]), tokens, tokens)
    floor = 6 * sum(m * k * n * (batch or 1) for batch, m, k, n in training.step_matmuls(s, workload))
    assert floor == pytest.approx(formula, rel=0.005)
    assert floor < formula  # what is left out is the bias and LayerNorm parameters


def test_floor_computes_each_matmul_and_both_gradients():
    shapes = [(None, 6, 4, 5), (3, 2, 4, 2)]
    outputs = training.matmul_floor(shapes, "float32")()
    rng = tf.random.Generator.from_seed(0)  # the floor's operands, drawn in the same order
    for (batch, m, k, n), (y, dx, dw) in zip(shapes, outputs):
        lead = () if batch is None else (batch,)
        x, w, dy = (rng.normal(lead + shape).numpy() for shape in ((m, k), (k, n), (m, n)))
        np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx, dy @ np.swapaxes(w, -1, -2), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw, np.swapaxes(x, -1, -2) @ dy, rtol=1e-5, atol=1e-5)
    assert outputs[1][0].shape == (3, 2, 2) and outputs[1][2].shape == (3, 4, 2)
