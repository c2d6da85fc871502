import pytest

from tfformer.recipes import language_model


@pytest.mark.parametrize("tokens, on_gpu, expected", [
    (32 * 128, False, 2),  # gpt-mini's default batch on a CPU: the benchmark LM, 5-10% faster in two
    (64 * 16, False, 1),  # transformer-tiny-sized steps are 5% slower in two
    (4095, False, 1),
    (32 * 128, True, 1),  # a GPU runs its kernels one after another: nothing to overlap
])
def test_default_micro_batches(tokens, on_gpu, expected):
    assert language_model.default_micro_batches(tokens, on_gpu) == expected
