"""The training benchmark's matmul floor: the same FLOPs as the stated formula, and the matmuls the step runs."""

import numpy as np
import pytest

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
    operands = training.floor_operands(shapes, "float32")
    expected_first = 0.0
    for (batch, m, k, n), (x, w, dy) in zip(shapes, operands):
        x, w, dy = x.numpy(), w.numpy(), dy.numpy()
        assert x.shape == ((batch,) if batch else ()) + (m, k) and w.shape[-2:] == (k, n) and dy.shape[-2:] == (m, n)
        y, dx, dw = (t.numpy() for t in training.floor_matmuls(x, w, dy))
        np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx, dy @ np.swapaxes(w, -1, -2), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw, np.swapaxes(x, -1, -2) @ dy, rtol=1e-5, atol=1e-5)
        expected_first += sum(t.reshape(-1)[0]
                              for t in (x @ w, dy @ np.swapaxes(w, -1, -2), np.swapaxes(x, -1, -2) @ dy))
    # The floor runs all of them: its result is the sum of every product's first element.
    np.testing.assert_allclose(float(training.matmul_floor(shapes, "float32")()), expected_first, rtol=1e-5, atol=1e-5)
