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


def test_train_lm_reports_no_test_perplexity_without_a_test_split(tmp_path):
    from tfformer import data

    lines = [line for line in (f"value_{i} = compute(value_{i - 1}) + {i}" for i in range(1, 400))
             if data.split_of(line) != "test"]
    text = tmp_path / "corpus.py"
    text.write_text("\n".join(lines) + "\n")
    printed = []
    tiny = dict(text_files=[str(text)], time_budget="2m", batch_size=4, sequence_length=16, vocabulary_size=128,
                warmup_steps=10, eval_every=10, printer=printed.append, hidden_dim=16, num_heads=2,
                intermediate_dim=32, num_decoder_layers=1)
    with pytest.raises(ValueError, match="max_steps"):
        language_model.train_lm(str(tmp_path / "bad"), max_steps=0, **tiny)
    metrics = language_model.train_lm(str(tmp_path / "run"), max_steps=25, **tiny)  # the budget is a ceiling
    assert metrics["test_perplexity"] is None
    assert "no test perplexity: the test split is empty" in printed
    assert metrics["steps"] == 25 and 0 < metrics["train_seconds"] <= metrics["seconds"]
    assert metrics["val_perplexity"] > 1
    assert metrics["dtype_policy"] == "float32"


def _train_lm_in_a_fresh_process(tmp_path, before=""):
    """`train_lm(cpu_threads=True, micro_batches=2)` on a tiny corpus in a new interpreter; its JSON result."""
    from tests.harness import run_in_fresh_interpreter

    text = tmp_path / "corpus.py"
    text.write_text("\n".join(f"value_{i} = compute(value_{i - 1}) + {i}" for i in range(1, 400)) + "\n")
    return run_in_fresh_interpreter(f"""
        import json
        import tensorflow as tf
        from tfformer.recipes import language_model
        {before}
        try:
            metrics = language_model.train_lm(
                {str(tmp_path / "run")!r}, text_files=[{str(text)!r}], time_budget="8s", batch_size=4,
                sequence_length=16, vocabulary_size=128, warmup_steps=10, eval_every=10, micro_batches=2,
                cpu_threads=True, hidden_dim=16, num_heads=2, intermediate_dim=32, num_decoder_layers=1)
            result = {{"steps": metrics["steps"], "val_perplexity": metrics["val_perplexity"]}}
        except RuntimeError as error:
            result = {{"error": str(error)}}
        result["threads"] = tf.config.threading.get_intra_op_parallelism_threads()
        print(json.dumps(result))
        """, timeout=600)


def test_train_lm_cpu_threads_gives_each_micro_batch_its_share(tmp_path):
    import os

    result = _train_lm_in_a_fresh_process(tmp_path)
    assert result["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)  # 2 micro-batches, 1 replica
    assert result["steps"] > 0 and result["val_perplexity"] > 1


def test_train_lm_cpu_threads_refuses_once_tensorflow_runs(tmp_path):
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the thread count it would set is the default")
    result = _train_lm_in_a_fresh_process(tmp_path, before="tf.constant(0.0)  # the runtime starts")
    assert "must run before TensorFlow creates any tensor" in result["error"]
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
