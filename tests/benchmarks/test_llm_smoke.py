"""`python -m benchmarks.llm --smoke` runs (a 2-layer random model of SmolLM2's architecture, one round; the
numbers mean nothing), with no peers and with stand-ins for PyTorch and llama-bench, and every derived figure
agrees with the rows it is read from."""

import os

import keras
import numpy as np
import pytest

from benchmarks import llm
from tests.benchmarks import stand_in_peer
from tests.benchmarks.smoke import run_smoke


def smoke_parameters(s):
    """Parameters of the smoke model, counted from its shape: tied embedding, per layer Q/K/V/O (grouped
    key/value heads), gate + up + down, two RMSNorm scales; a final RMSNorm."""
    head_dim = s["hidden"] // s["heads"]
    attention = s["hidden"] * head_dim * (2 * s["heads"] + 2 * s["kv_heads"])
    feedforward = 3 * s["hidden"] * s["intermediate"]
    return s["vocab"] * s["hidden"] + s["layers"] * (attention + feedforward + 2 * s["hidden"]) + s["hidden"]


def test_llm_benchmark_smoke(peers):
    stdout, records = run_smoke("benchmarks.llm", peers.path, light_xla=True)
    # A worker that exists but fails is an error, not a skip.
    assert "worker failed" not in stdout and "worker did not start" not in stdout
    with_torch = with_llama = peers.kind != "none"
    assert ("PyTorch rows skipped" in stdout) != with_torch
    smoke = llm.SMOKE
    parameters = smoke_parameters(llm.SMOKE_SHAPE)

    (bandwidth,) = [r for r in records if r["bench"] == "llm_bandwidth"]
    assert set(bandwidth["read_gb_per_s"]) == {"1", str(len(os.sched_getaffinity(0)))}
    assert bandwidth["best_gb_per_s"] == max(bandwidth["read_gb_per_s"].values()) > 0
    # Bytes read per float32 token: every weight once, 4 bytes each; bfloat16 half.
    assert bandwidth["bytes_per_token"] == {"float32": 4 * parameters, "bfloat16": 2 * parameters}
    for dtype, limit in bandwidth["limit_tokens_per_s"].items():
        assert limit == pytest.approx(bandwidth["best_gb_per_s"] * 1e9 / bandwidth["bytes_per_token"][dtype],
                                      rel=0.01)

    llama = [r for r in records if r.get("system") == llm.LLAMA and r["bench"] != "llm_perplexity"]
    decode = {r["system"]: r for r in records if r["bench"] == "llm_decode" and r not in llama}
    prefill = {r["system"]: r for r in records if r["bench"] == "llm_prefill" and r not in llama}
    skipped = {r["system"]: r["reason"] for r in records if r["bench"] == "skipped"}
    ours = {"tfformer float32", "tfformer bfloat16"}
    torch_rows = {"pytorch float32", "pytorch bfloat16"}
    assert ours <= set(decode) and ours <= set(prefill)
    assert (torch_rows <= set(decode) and torch_rows <= set(prefill)) == with_torch
    assert with_torch or not torch_rows & (set(decode) | set(prefill))
    # TFLite int8 decode is a row, or a skip that says why; llama.cpp is always accounted for.
    assert ("tflite int8" in decode) != ("tflite int8" in skipped)
    # The same file as the export writes it by default: a cache of the model's max_sequence_length, not the run's.
    assert ("tflite int8-default" in decode) != ("tflite int8-default" in skipped)
    if "tflite int8-default" in decode:
        assert decode["tflite int8-default"]["max_length"] == llm.SMOKE_SHAPE["max_length"]
        assert decode["tflite int8"]["max_length"] == smoke["prompt"] + smoke["new_tokens"]
    # The GGUF-exact file needs GGUF blocks, which the random smoke model has not: a skip that says so.
    assert "tflite gguf-int8" not in decode and "no Q8_0 / Q4_1 block weights" in skipped["tflite gguf-int8"]
    # llama.cpp: llama-bench's three tests at the smoke's sizes, or a skip that names what is missing.
    if with_llama:
        assert "llama.cpp" not in skipped
        tests = {(r["bench"], r["prompt_length"], r["new_tokens"]) for r in llama}
        assert tests == {("llm_prefill", smoke["prefill"], 0), ("llm_decode_only", 0, smoke["new_tokens"]),
                         ("llm_decode", smoke["prompt"], smoke["new_tokens"])}
        for r in llama:
            # llama-bench's mean tokens/s and mean time of its repeats: the mean of rates is not the rate of the
            # means but at least it (arithmetic >= harmonic mean), and the real binary's few-millisecond smoke
            # repeats spread widely (72 tokens/s against 11 from the mean time seen, one repeat 6x the others).
            rate_of_mean = (r["prompt_length"] + r["new_tokens"]) / r["seconds"]
            if peers.kind == "stand-in":
                assert r["tokens_per_s"] == pytest.approx(rate_of_mean, rel=0.01)
            else:
                assert r["tokens_per_s"] >= 0.99 * rate_of_mean
            assert r["threads"] == len(os.sched_getaffinity(0)) and r["file_bytes"] > 0
    else:
        assert not llama and "make peers" in skipped["llama.cpp"]
    for name, r in decode.items():
        assert (r["prompt_length"], r["new_tokens"], r["short_tokens"]) == (smoke["prompt"], smoke["new_tokens"],
                                                                            smoke["short_tokens"])
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["seconds"], rel=0.01)
        dtype = r["system"].split()[-1]
        # TFLite int8: a step reads the file's weights once.
        assert r["bytes_per_token"] == bandwidth["bytes_per_token"].get(dtype, r.get("file_bytes"))
        cap = bandwidth["best_gb_per_s"] * 1e9 / r["bytes_per_token"]
        assert r["whole_call_fraction_of_bandwidth_limit"] == pytest.approx(r["tokens_per_s"] / cap, rel=0.02,
                                                                            abs=1e-3)
        if r["seconds"] > r["short_seconds"]:  # the decode-only reading: the prefill cancelled
            assert r["decode_tokens_per_s"] == pytest.approx(
                (r["new_tokens"] - r["short_tokens"]) / (r["seconds"] - r["short_seconds"]), rel=0.01)
            assert r["fraction_of_bandwidth_limit"] == pytest.approx(r["decode_tokens_per_s"] / cap, rel=0.02,
                                                                     abs=1e-3)
        else:
            assert r["decode_tokens_per_s"] is None and r["fraction_of_bandwidth_limit"] is None
        if name in ours or (name in torch_rows and r["torch"] != "stand-in"):  # one architecture and shape
            assert r["parameters"] == parameters, name
    for r in prefill.values():
        assert r["prompt_length"] == smoke["prefill"]
        assert r["tokens_per_s"] == pytest.approx(r["prompt_length"] / r["seconds"], rel=0.01)

    # Perplexity: tfformer's on the smoke's random ids (two chunks, each scoring its second half), llama.cpp's from
    # llama-perplexity on the held-out text (the stand-in's made-up value, or a skip that names what is missing).
    perplexity = {r["system"]: r for r in records if r["bench"] == "llm_perplexity"}
    context = llm.PERPLEXITY_CONTEXT["smoke"]
    ours_ppl = perplexity["tfformer float32"]
    assert (ours_ppl["context"], ours_ppl["tokens"], ours_ppl["text"]) == (context, 2 * (context // 2 - 1),
                                                                          "random ids")
    assert 1 < ours_ppl["perplexity"] < 10 * llm.SMOKE_SHAPE["vocab"]
    assert "litert-lm int4" not in perplexity and "tokenizer" in skipped["litert-lm int4"]
    if peers.kind == "stand-in":
        assert perplexity[llm.LLAMA]["perplexity"] == stand_in_peer.PERPLEXITY
        assert perplexity[llm.LLAMA]["chunks"] == os.path.getsize(llm.HELDOUT) // context
    elif with_llama:
        assert perplexity[llm.LLAMA]["perplexity"] > 1 and perplexity[llm.LLAMA]["chunks"] > 1
    else:
        assert llm.LLAMA not in perplexity and "make peers" in skipped["llama.cpp perplexity"]

    (memory,) = [r for r in records if r["bench"] == "llm_memory"]
    assert memory["weights_bytes"] == 4 * parameters
    assert 0 < memory["before_load_mb"] <= memory["peak_rss_mb"]
    assert memory["peak_over_weights"] == pytest.approx(memory["peak_rss_mb"] * 2**20 / (4 * parameters), rel=0.01)

    # Ratios against PyTorch (seconds: theirs / ours; one round, so per round = of the medians), and the goals.
    ratios = {r["compared"]: r for r in records if r["bench"] == "llm_ratio"}
    goals = {r["goal"]: r for r in records if r["bench"] == "goal"}
    for r in goals.values():
        assert r["met"] == (r["value"] >= r["target"] if r["at_least"] else r["value"] <= r["target"])
    expected = {"llm float32 decode >= 0.75 of the read-bandwidth limit",
                "llm peak memory while loading <= 2.0x the float32 weights"}
    if with_torch:
        for dtype in ("float32", "bfloat16"):
            call = ratios[f"{dtype} decode call"]
            assert call["ratio"] == pytest.approx(decode[f"tfformer {dtype}"]["tokens_per_s"]
                                                  / decode[f"pytorch {dtype}"]["tokens_per_s"], rel=0.02)
            assert call["per_round"] == pytest.approx([call["ratio"]] * 3, rel=1e-3)
            goal = goals[f"llm {dtype} decode >= 1.5x PyTorch {dtype}"]
            assert goal["value"] == pytest.approx(call["ratio"], rel=1e-3) and goal["target"] == 1.5
            first = ratios[f"{dtype} prefill"]
            assert first["ratio"] == pytest.approx(prefill[f"pytorch {dtype}"]["seconds"]
                                                   / prefill[f"tfformer {dtype}"]["seconds"], rel=0.05)
            goal = goals[f"llm {dtype} {smoke['prefill']}-token prefill >= 1.0x PyTorch {dtype}"]
            assert goal["value"] == pytest.approx(first["ratio"], rel=1e-3)
            expected |= {f"llm {dtype} decode >= 1.5x PyTorch {dtype}",
                         f"llm {dtype} {smoke['prefill']}-token prefill >= 1.0x PyTorch {dtype}"}
    else:
        assert not ratios
    assert set(goals) == expected
    f32 = decode["tfformer float32"]
    goal = goals["llm float32 decode >= 0.75 of the read-bandwidth limit"]
    reading = f32["fraction_of_bandwidth_limit"] or f32["whole_call_fraction_of_bandwidth_limit"]
    assert goal["value"] == pytest.approx(reading, rel=1e-3)
    goal = goals["llm peak memory while loading <= 2.0x the float32 weights"]
    # What loading costs: the peak over the imports; the whole process's peak beside it.
    assert not goal["at_least"] and goal["value"] == pytest.approx(memory["increase_over_weights"], rel=1e-3)
    assert goal["other_readings"]["whole process peak"] == pytest.approx(memory["peak_over_weights"], rel=1e-3)
    assert "Goals (ratios of the medians):" in stdout and "| system | tokens_per_s |" in stdout


def test_chunk_log_probs_score_the_second_half_as_llama_perplexity_does():
    """llama-perplexity's protocol: in a chunk of n tokens, the tokens n/2 + 1 .. n - 1, each from the logits at
    the position before it; against Keras' own log-softmax."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, 5)) * 10
    chunk = rng.integers(0, 5, size=8)
    expected = keras.ops.convert_to_numpy(keras.ops.log_softmax(logits.astype("float64"), axis=-1))
    scores = llm.chunk_log_probs(logits, chunk)
    np.testing.assert_allclose(scores, [expected[i, chunk[i + 1]] for i in range(4, 7)], rtol=1e-12)


def test_llama_rounds_take_each_tests_median_and_keep_every_round():
    """Rounds of `llama-bench -r 1`, each run after one of LiteRT-LM's, as one row per test: the median tokens/s
    and seconds of the rounds, each round's tokens/s in order; a failed round's reason instead of rows."""
    def row(bench, prompt, new, tokens_per_s):
        return {"bench": bench, "system": llm.LLAMA, "prompt_length": prompt, "new_tokens": new,
                "tokens_per_s": tokens_per_s, "tokens_per_s_stdev": 0.0, "seconds": (prompt + new) / tokens_per_s}

    rounds = [[row("llm_prefill", 512, 0, p), row("llm_decode_only", 0, 128, d)]
              for p, d in ((400.0, 90.0), (200.0, 130.0), (300.0, 60.0))]
    combined = {r["bench"]: r for r in llm.llama_rounds(rounds)}
    assert combined["llm_prefill"]["tokens_per_s"] == 300.0 and combined["llm_decode_only"]["tokens_per_s"] == 90.0
    assert combined["llm_decode_only"]["tokens_per_s_rounds"] == [90.0, 130.0, 60.0]
    assert combined["llm_prefill"]["seconds"] == pytest.approx(512 / 300.0, rel=1e-3)
    assert combined["llm_decode_only"]["tokens_per_s_stdev"] == pytest.approx(np.std([90.0, 130.0, 60.0]), abs=0.01)
    assert all(r["rounds"] == 3 and "-r 1" in r["reading"] for r in combined.values())
    assert llm.llama_rounds([rounds[0], "llama-bench failed (1): oops"]) == "llama-bench failed (1): oops"
    assert llm.llama_rounds([]) == "llama-bench ran no rounds"
