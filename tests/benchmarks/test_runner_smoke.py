"""The benchmark runner must not rot: its smoke mode runs in CI (numbers are meaningless there), with no PyTorch
worker and with a stand-in for it.

The run with the stand-in times only what the peer changes (`--systems peers`): the PyTorch rows and the rows
they are read against (tfformer's; in training keras-hub float32 too, every row's baseline). Everything else
(keras-hub's generation rows, the "+metrics" and "+cpu_threads" training rows, the floors, the cold and per-token
rows, the goals, tflite) is the run without peers', and the run with the real peers (`make peers`) times it all."""

import json
import os
import subprocess
import sys

import pytest

from tests.benchmarks.smoke import smoke_env
from tfformer.generation.plan import native_bfloat16_on_this_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_runner_smoke(peers):
    # tflite has no peer: the run without peers covers it. The stand-in's run: only the rows its peer changes.
    tflite = peers.kind == "none"
    every_system = peers.kind != "stand-in"
    workloads = ["training", "generation", *(["tflite"] if tflite else [])]
    options = [] if every_system else ["--systems", "peers"]
    out = subprocess.run([sys.executable, "-m", "benchmarks", "run", *workloads, "--smoke", *options], cwd=ROOT,
                         capture_output=True, text=True, timeout=900, env=smoke_env(peers.path, light_xla=True))
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    benches = {r["bench"] for r in records}
    cores = len(os.sched_getaffinity(0))
    every_system_benches = {"generation_ratio", "generation_cold", "generation_cold_ratio", "per_token",
                            "per_token_ratio", "goal"}
    assert {"train_seq2seq", "train_lm", "generation", *(every_system_benches if every_system else []),
            *(["latency_batch1"] if tflite else [])} <= benches
    assert every_system or not every_system_benches & benches
    # PyTorch rows are there when an interpreter with torch + transformers exists, else the skip is said; a
    # worker that exists but fails is an error, not a skip.
    with_torch = peers.kind != "none"
    assert ("PyTorch rows skipped" in out.stdout) != with_torch
    assert "worker failed" not in out.stdout and "worker did not start" not in out.stdout
    # Ratios agree with the rows they come from; with one round (smoke), per round = the ratio of the medians.
    speed = {(r["batch"], r["system"]): r["tokens_per_s"] for r in records if r["bench"] == "generation"}
    assert {batch for batch, _ in speed} == {1, 2}  # batch 2: the batch > 1 decode paths run too
    for r in (r for r in records if r["bench"] == "generation_ratio"):
        assert r["ratio"] == pytest.approx(speed[(r["batch"], r["tfformer"])] / speed[(r["batch"], r["keras_hub"])],
                                           rel=0.01)
        assert r["per_round"] == pytest.approx([r["ratio"]] * 3, rel=0.01)
    for r in (r for r in records if r["bench"] == "generation_ratio_pytorch"):
        ratio = speed[(r["batch"], r["tfformer"])] / speed[(r["batch"], r["pytorch"])]
        assert r["ratio"] == pytest.approx(ratio, rel=0.01)
        assert r["per_round"] == pytest.approx([r["ratio"]] * 3, rel=0.01)
    assert with_torch == any(r["bench"] == "generation_ratio_pytorch" for r in records)
    # PyTorch's rows are compared with tfformer's fastest (with --systems peers: tfformer's rows, no keras-hub's).
    for r in (r for r in records if r["bench"] == "generation_ratio_pytorch"):
        assert r["tfformer"] == max((s for b, s in speed if b == r["batch"] and s.startswith("tfformer")),
                                    key=lambda s: speed[(r["batch"], s)])
    libraries = {system.split()[0] for _, system in speed}
    assert libraries == {"tfformer", *(["keras-hub"] if every_system else []), *(["pytorch"] if with_torch else [])}
    # Batch 1 on cold cores: each system's fastest setting (by its median above), its ratio from those rows.
    if every_system:
        cold = {r["system"]: r for r in records if r["bench"] == "generation_cold"}
        fastest = {system: max((s for b, s in speed if b == 1 and s.startswith(system)), key=lambda s: speed[(1, s)])
                   for system in ("tfformer", "keras-hub")}
        assert set(cold) == set(fastest.values()) and all(r["idle_seconds"] == 0.3 for r in cold.values())
        (cold_ratio,) = [r for r in records if r["bench"] == "generation_cold_ratio"]
        assert (cold_ratio["tfformer"], cold_ratio["keras_hub"]) == (fastest["tfformer"], fastest["keras-hub"])
        assert cold_ratio["ratio"] == pytest.approx(
            cold[fastest["keras-hub"]]["seconds"] / cold[fastest["tfformer"]]["seconds"], rel=0.01)
    torch_systems = {"pytorch float32", "pytorch bfloat16"}
    for bench in ("train_seq2seq", "train_lm"):
        rows = {r["system"]: r for r in records if r["bench"] == bench}
        strict = {"tfformer float32", "tfformer bfloat16", "keras-hub float32"}  # what PyTorch's rows are read against
        assert strict <= set(rows)
        if every_system:
            assert {"matmul floor float32", "matmul floor bfloat16"} <= set(rows)
        else:
            assert {name for name in rows if not name.startswith("pytorch")} == strict
        assert all(0 < r["peak_rss_mb"] <= r["peak_rss_mb_with_floors"] for r in rows.values())
        # tfformer's systems train in two micro-batches (the smoke batch of 4 in parts of 2).
        assert {name for name, r in rows.items() if r.get("micro_batches") == 2} == {
            name for name in rows if name.startswith("tfformer")}
        if every_system:
            # Each library compiled as documented ("+metrics") is compared with keras-hub's task defaults, the rest
            # with keras-hub given tfformer's loss and no metrics.
            assert {f"{system} +metrics" for system in strict} <= set(rows)
            # tfformer in a worker process with one share of the cores per micro-batch
            # (training.configure_cpu_threads).
            for dtype in ("float32", "bfloat16"):
                threaded = rows[f"tfformer {dtype} +cpu_threads"]
                assert threaded["intra_op_threads"] == max(1, cores // 2) and threaded["micro_batches"] == 2
                assert threaded["parameters"] == rows[f"tfformer {dtype}"]["parameters"]
        for name, r in rows.items():
            # GFLOP/s against the limit of the row's own dtype, timed in the same rounds.
            limit = r["bf16_limit_gflops"] if "bfloat16" in name else r["f32_limit_gflops"]
            # 4 significant digits each, the fractions 2 decimals (a smoke limit can read below the model's speed)
            assert r["gflops"] > 0 and r["fraction_of_own_limit"] == pytest.approx(r["gflops"] / limit, rel=2e-3,
                                                                                   abs=0.011)
            assert r["fraction_of_f32_limit"] == pytest.approx(r["gflops"] / r["f32_limit_gflops"], rel=2e-3,
                                                               abs=0.011)
            assert r["baseline"] == ("keras-hub float32 +metrics" if name.endswith("+metrics") else "keras-hub float32")
            base = rows[r["baseline"]]["tokens_per_s"]
            assert r["ratio_vs_keras_hub"] == pytest.approx(r["tokens_per_s"] / base, abs=0.011)
            assert r["per_round"] == pytest.approx([r["tokens_per_s"] / base] * 3, rel=0.01)
        versus = {r["dtype"]: r for r in records if r["bench"] == f"{bench}_vs_pytorch"}
        if not with_torch:
            assert not torch_systems & set(rows) and not versus
            continue
        # bfloat16 where the CPU has bfloat16 instructions, else skipped and said (PyTorch would emulate them).
        dtypes = {"float32", "bfloat16"} if native_bfloat16_on_this_cpu() else {"float32"}
        assert {f"pytorch {dtype}" for dtype in dtypes} == torch_systems & set(rows) and set(versus) == dtypes
        assert ("PyTorch bfloat16 rows skipped" in out.stdout) == (dtypes == {"float32"})
        for dtype, r in versus.items():
            ratio = rows[f"tfformer {dtype}"]["tokens_per_s"] / rows[f"pytorch {dtype}"]["tokens_per_s"]
            assert r["ratio"] == pytest.approx(ratio, rel=0.01)
            assert r["per_round"] == pytest.approx([ratio] * 3, rel=0.01)
        # The same shapes: GPT-2 in Keras and in transformers has the same parameters; nn.Transformer adds a final
        # LayerNorm to its encoder and its decoder (2 x 2 x hidden) to keras-hub's seq2seq layout.
        extra = 0 if bench == "train_lm" else 4 * 16  # the smoke shape's hidden size
        if rows["pytorch float32"]["torch"] != "stand-in":
            assert rows["pytorch float32"]["parameters"] == rows["keras-hub float32"]["parameters"] + extra
    # Per-token time: the tokens measured (those between the smoke's 2 and 6 new ones) are centred on each
    # position, so the prompts end (2 + 6) / 2 tokens before it.
    per_token = {r["position"]: r for r in records if r["bench"] == "per_token"}
    assert {p: (r["prompt_length"], r["new_tokens"]) for p, r in per_token.items()} == (
        {8: (4, [2, 6]), 32: (28, [2, 6])} if every_system else {})
    # TFLite and the SavedModel on the same threads: this process's cores; each ratio is its own time / the
    # SavedModel's (one round: per round = of the medians).
    latency = {r["system"]: r for r in records if r["bench"] == "latency_batch1"}
    assert {r["cores"] for r in records} == {cores} and bool(latency) == tflite
    if tflite:
        assert set(latency) == {"saved_model", "tflite float32", "tflite float32 batch=1 static", "tflite dynamic",
                                "tflite dynamic batch=1 static"}
        assert {r["threads"] for r in latency.values()} == {cores}
    for r in latency.values():
        assert r["ratio_vs_saved_model"] == pytest.approx(r["per_round"][0], abs=0.006) and r["ms"] > 0
    assert "over rounds" in out.stdout
    assert all(r.get("tokens_per_s", 1) > 0 for r in records)
    assert "| system |" in out.stdout or "| bench |" in out.stdout
    # The goals, each as a line read from the rows above: training from the "+metrics" rows (each library
    # as its documentation compiles it), the strict and +cpu_threads readings beside them. None with the stand-in
    # (--systems peers: the rows they are read from are the run without peers').
    goals = {r["goal"]: r for r in records if r["bench"] == "goal"}
    assert ("Goals (ratios of the medians" in out.stdout) == every_system
    for r in goals.values():
        assert r["met"] == (r["value"] >= r["target"] if r["at_least"] else r["value"] <= r["target"])
    if not every_system:
        assert not goals
        return
    for bench in ("train_seq2seq", "train_lm"):
        rows = {r["system"]: r for r in records if r["bench"] == bench}
        for dtype, target in (("float32", 1.25), ("bfloat16", 2)):
            r = goals[f"training {bench[len('train_'):]} {dtype} >= {target}x keras-hub float32"]
            assert r["target"] == target and r["at_least"] and r["reading"] == "+metrics"
            assert r["value"] == pytest.approx(rows[f"tfformer {dtype} +metrics"]["ratio_vs_keras_hub"], abs=0.006)
            assert r["other_readings"]["strict"] == pytest.approx(rows[f"tfformer {dtype}"]["ratio_vs_keras_hub"],
                                                                  abs=0.006)
            assert r["other_readings"]["+cpu_threads"] == pytest.approx(
                rows[f"tfformer {dtype} +cpu_threads"]["ratio_vs_keras_hub"], abs=0.006)
    best = [r for r in records if r["bench"] == "generation_ratio"]
    for batch, target in ((1, 2), (2, 1.5)):  # the smoke's batch 2 stands for the batch 8
        r = goals[f"generation batch {batch} >= {target}x keras-hub's fastest"]
        tfformer, keras_hub = r["rows"]
        # Each library's fastest setting; the same pair can be both "best" and its setting's own comparison.
        for name, library in ((tfformer, "tfformer"), (keras_hub, "keras-hub")):
            assert name == max((s for b, s in speed if b == batch and s.startswith(library)),
                               key=lambda s: speed[(batch, s)])
        (ratio,) = {b["ratio"] for b in best if (b["batch"], b["tfformer"], b["keras_hub"]) == (batch, *r["rows"])}
        assert r["value"] == pytest.approx(ratio, rel=1e-3)
    (per_token_ratio,) = [r for r in records if r["bench"] == "per_token_ratio"]
    r = goals["per-token time at 32 <= 1.5x at 8"]
    assert not r["at_least"] and r["value"] == pytest.approx(per_token_ratio["ratio"], abs=0.001)
    if tflite:
        r = goals["tflite batch-1 latency <= 0.6x the SavedModel's"]
        assert not r["at_least"]
        assert r["value"] == pytest.approx(latency["tflite float32"]["ratio_vs_saved_model"], abs=0.006)
    assert len(goals) == 7 + tflite
    assert ("Goal (ratio" in out.stdout) == tflite  # the tflite workload's one goal line
