"""Greedy generation speed: tfformer vs keras-hub GPT2CausalLM of the same shape, same process, interleaved.

Shape (the issue's): vocab 8192, 4 layers, hidden 256, 4 heads, intermediate 1024; 16-token prompts,
128 new tokens, batch 1 and 8; a new random prompt each round; random weights, no early stop. Each system
with and without XLA, in float32 and under the mixed_bfloat16 policy (what a model trained with
`--mixed-precision` runs in; logits stay float32; at batch 1 under XLA tfformer's decode step reads its
kernels in the compute dtype and multiplies in float32, `generation.plan.DecodePlan`'s "rows", so there its "bf16"
row reads half the layer weights' bytes a step). "Best" is each system's fastest row.
Also: tfformer's per-token time at positions 50 and 500, from two calls per position that generate 16 and 48
tokens after a prompt of `position - 32` tokens: their difference is the time of the 32 tokens written at
`position - 16` to `position + 15`, centred on the position, with the prefill cancelled out. Each tfformer/keras-hub
ratio is printed twice: of the medians, and per round (median, min-max of each round's own pair,
`common.paired_ratio`), which shows its spread. Decoding is bound by memory traffic, not FLOPs, so no GFLOP/s here.
Every timed call starts on busy cores (`common.interleaved`'s warm-up); "cold" rows time batch 1 of each system's
fastest setting after `COLD_IDLE_SECONDS` of idle cores instead, which on these VMs costs a call that spreads short
kernels over both cores far more than a single-threaded one.
PyTorch rows, when an interpreter with torch + transformers exists (`benchmarks.torch_worker`): transformers'
`GPT2LMHeadModel` of the same shape, `generate` greedy with its KV cache, float32 and under `torch.autocast`
bfloat16, the first round's prompts, as many intra-op threads as TensorFlow's default (the cores it may use),
timed in the worker process and interleaved with the rest; "tfformer best / PyTorch best" compares each
system's fastest row.
With `--systems peers` (smoke runs only) a run times only the PyTorch rows and tfformer's, which they are read
against: no keras-hub rows, cold rows, per-token times or goals.

    python -m benchmarks.generation [--smoke] [--torch-python PYTHON] [--systems all|peers]
"""

import argparse
import time

import keras
import keras_hub
import numpy as np

from benchmarks import common, torch_worker
from tfformer import generation, models

COLD_IDLE_SECONDS = 0.3  # long enough for these VMs' idle-core slowdown (docs/performance.md, "Cold cores")


def build(shape, max_length, policy="float32", keras_hub_tasks=True):
    """tfformer's model and keras-hub's tasks by XLA setting (none without `keras_hub_tasks`) under `policy`."""
    keras.config.set_dtype_policy(policy)
    try:
        return _build(shape, max_length, xla_settings=(False, True) if keras_hub_tasks else ())
    finally:
        keras.config.set_dtype_policy("float32")


def _build(shape, max_length, xla_settings):
    config = models.TransformerConfig(architecture="causal_lm", vocabulary_size=shape["vocab"],
                                      hidden_dim=shape["hidden"], num_heads=shape["heads"],
                                      intermediate_dim=shape["intermediate"],
                                      num_encoder_layers=0, num_decoder_layers=shape["layers"], dropout=0.0,
                                      max_sequence_length=max_length, activation="gelu_approximate", norm_first=True,
                                      position="learned", scale_embeddings=False)
    ours = models.build_causal_lm(config)
    if not xla_settings:
        return ours, {}
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=shape["vocab"], num_layers=shape["layers"],
                                             num_heads=shape["heads"], hidden_dim=shape["hidden"],
                                             intermediate_dim=shape["intermediate"], max_sequence_length=max_length)
    # One task per XLA setting, sharing the backbone: compile() would otherwise drop the cached generate function.
    theirs = {}
    for xla in xla_settings:
        theirs[xla] = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        theirs[xla].compile(sampler="greedy", jit_compile=xla)
    return ours, theirs


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    torch_worker.add_python_option(parser, "generate")
    common.add_systems_option(parser)
    args = parser.parse_args(argv)
    common.check_systems(parser, args)
    peers_only = args.systems == "peers"  # the PyTorch rows and tfformer's, which they are read against, alone
    shape = dict(vocab=8192, layers=4, hidden=256, heads=4, intermediate=1024)
    # 15 rounds: each call takes tens of ms to a second, and one slow stretch of the VM can move a median of a few
    # rounds far off; the whole workload takes ~4 minutes.
    prompt_len, new_tokens, repeats, batches = 16, 128, 15, (1, 8)
    if args.smoke:
        shape = dict(vocab=64, layers=1, hidden=16, heads=2, intermediate=32)
        prompt_len, new_tokens, repeats, batches = 4, 8, 1, (1, 2)  # batch 2: the batch > 1 paths
    max_length = 1024 if not args.smoke else 64
    rng = np.random.default_rng(0)
    # A new prompt each round, the same for every system in that round (warm-up included): a compile cache keyed
    # by the prompt's values (e.g. one XLA compilation per prompt) shows.
    # The PyTorch worker, eager, runs the first.
    prompts = {batch: rng.integers(4, shape["vocab"], size=(1 + 2 * repeats, batch, prompt_len)).astype("int32")
               for batch in batches}  # (rounds, B, P): the warm-up, the rounds, the cold rounds (batch 1)
    # The PyTorch worker builds its model while the Keras models are built.
    # As many intra-op threads as TensorFlow's default here: the cores this process may use.
    spec = {"shape": shape, "max_length": max_length, "new_tokens": new_tokens, "threads": common.cores()}
    arrays = {f"batch_{b}": p[0] for b, p in prompts.items()}
    with torch_worker.start("generate", spec, arrays, args.torch_python) as pending:
        ours, theirs = build(shape, max_length, keras_hub_tasks=not peers_only)
        ours16, theirs16 = build(shape, max_length, "mixed_bfloat16", keras_hub_tasks=not peers_only)
        worker = pending.ready()
        rows, round_times, batch_calls = [], {}, {}

        def best(system, b):  # the fastest setting (by median) of one system at batch b
            return max((r for r in rows if r["batch"] == b and r["system"].startswith(system)),
                       key=lambda r: r["tokens_per_s"])

        for batch in batches:
            ids = prompts[batch]  # (rounds, B, P)
            padded = [{"token_ids": np.pad(p, [[0, 0], [0, new_tokens]]),  # keras-hub's input: (B, P + N)
                       "padding_mask": np.pad(np.ones_like(p, dtype=bool), [[0, 0], [0, new_tokens]])} for p in ids]
            calls = {}  # name -> fn(round); `ids` and `padded` bound now: the cold rounds below call batch 1's again
            for xla in (False, True):
                calls[f"tfformer xla={xla}"] = (lambda i, xla=xla, ids=ids: generation.generate_ids(
                    ours, ids[i], new_tokens, jit_compile=xla, end_id=-1).numpy())
                if xla in theirs:
                    calls[f"keras-hub xla={xla}"] = (lambda i, xla=xla, padded=padded: theirs[xla].generate(
                        padded[i], stop_token_ids=None))
            for xla in (False, True):
                calls[f"tfformer bf16 xla={xla}"] = (lambda i, xla=xla, ids=ids: generation.generate_ids(
                    ours16, ids[i], new_tokens, jit_compile=xla, end_id=-1).numpy())
                if xla in theirs16:
                    calls[f"keras-hub bf16 xla={xla}"] = (lambda i, xla=xla, padded=padded: theirs16[xla].generate(
                        padded[i], stop_token_ids=None))
            calls = {name: common.timed(common.rounds(fn)) for name, fn in calls.items()}
            batch_calls[batch] = dict(calls)
            if worker is not None:
                for dtype in ("float32", "bfloat16"):
                    calls[f"pytorch {dtype}"] = lambda dtype=dtype, batch=batch: worker.run(f"{dtype} {batch}")
            times = round_times[batch] = common.interleaved(calls, repeats=repeats, warmup=1, self_timed=True)
            for name, values in times.items():
                seconds = common.median(values)
                extra = {"peak_rss_mb": round(common.peak_rss_mb())}
                if name.startswith("pytorch"):  # the worker's own process
                    extra = {"peak_rss_mb": worker.peak_rss_mb, "torch": worker.info["torch"]}
                tokens_per_s = round(batch * new_tokens / seconds, 1)
                rows.append(common.emit({"bench": "generation", "system": name, "batch": batch,
                                         "new_tokens": new_tokens, "tokens_per_s": tokens_per_s,
                                         "seconds": round(seconds, 4), **extra}))
        if not peers_only:
            fastest = {system: best(system, 1)["system"] for system in ("tfformer", "keras-hub")}
            cold_text = _cold_rows(batch_calls[1], fastest, repeats, new_tokens)

    ratio_rows = []  # the table's: tfformer's speed / the other's, of the medians and per round

    def compare(b, compared, ours_name, theirs_name, bench, other_key):
        ours_times, theirs_times = round_times[b][ours_name], round_times[b][theirs_name]
        of_medians = common.median(theirs_times) / common.median(ours_times)
        per_round = common.paired_ratio(ours_times, theirs_times)  # (median, min, max) of each round's pair
        ratio_rows.append({"batch": b, "compared": compared, "tfformer": ours_name, "versus": theirs_name,
                           "ratio": f"{of_medians:.2f}", "per round": common.ratio_text(per_round)})
        common.emit({"bench": bench, "batch": b, "tfformer": ours_name, other_key: theirs_name,
                     "ratio": common.significant(of_medians), "per_round": [common.significant(x) for x in per_round]})
        return of_medians

    goals = []
    for b in batches:
        pairs = {} if peers_only else {
            "best": (best("tfformer", b)["system"], best("keras-hub", b)["system"]),
            **{tag: (f"tfformer {tag}", f"keras-hub {tag}")
               for tag in ("xla=False", "xla=True", "bf16 xla=False", "bf16 xla=True")}}
        for label, (ours_name, theirs_name) in pairs.items():
            ratio = compare(b, label, ours_name, theirs_name, "generation_ratio", "keras_hub")
            if label == "best":  # the issue's: batch 1 >= 2x keras-hub's fastest setting, batch 8 >= 1.5x
                target = 2 if b == 1 else 1.5
                goals.append(common.goal(f"generation batch {b} >= {target}x keras-hub's fastest", ratio, target,
                                         rows=[ours_name, theirs_name]))
        if worker is not None:
            compare(b, "best vs PyTorch", best("tfformer", b)["system"], best("pytorch", b)["system"],
                    "generation_ratio_pytorch", "pytorch")
    if not peers_only:
        per_token_text = _per_token_rows(ours, rng, shape["vocab"], args.smoke, repeats, goals)
    print()
    print(common.table(rows, ["system", "batch", "tokens_per_s", "seconds", "peak_rss_mb"]))
    print()  # > 1: tfformer generates faster
    print(common.table(ratio_rows, ["batch", "compared", "tfformer", "versus", "ratio", "per round"]))
    if not peers_only:
        print(per_token_text)
        print(cold_text)
        common.print_goals(goals, "Goals (ratios of the medians):")


def _cold_rows(calls, fastest, repeats, new_tokens):
    """Batch 1 on cold cores: each system's fastest setting (`fastest`: {system: its name in `calls`, the
    self-timed calls of batch 1 by name}), each call after the cores idled `COLD_IDLE_SECONDS` (what a sparse
    stream of requests sees on these VMs; the rounds of `main` start on busy cores, `common.interleaved`), on new
    prompts. Emits their rows and ratio; returns the line that sums them up."""
    cold = common.interleaved({name: _after_idle(calls[name]) for name in fastest.values()},
                              repeats=repeats, warmup=0, self_timed=True, warm_seconds=0)
    cold_seconds = {name: common.median(values) for name, values in cold.items()}
    for name, seconds in cold_seconds.items():
        common.emit({"bench": "generation_cold", "system": name, "batch": 1, "idle_seconds": COLD_IDLE_SECONDS,
                     "new_tokens": new_tokens, "seconds": common.significant(seconds)})
    cold_ratio = cold_seconds[fastest["keras-hub"]] / cold_seconds[fastest["tfformer"]]
    cold_per_round = common.paired_ratio(cold[fastest["tfformer"]], cold[fastest["keras-hub"]])
    common.emit({"bench": "generation_cold_ratio", "batch": 1, "tfformer": fastest["tfformer"],
                 "keras_hub": fastest["keras-hub"], "ratio": common.significant(cold_ratio),
                 "per_round": [common.significant(x) for x in cold_per_round]})
    return (f"batch 1 after {COLD_IDLE_SECONDS} s of idle cores: {fastest['tfformer']} "
            f"{cold_seconds[fastest['tfformer']]:.4f} s, {fastest['keras-hub']} "
            f"{cold_seconds[fastest['keras-hub']]:.4f} s, ratio {cold_ratio:.2f}; per round "
            f"{common.ratio_text(cold_per_round)}")


def _per_token_rows(ours, rng, vocab, smoke, repeats, goals):
    """tfformer's per-token time at positions 50 and 500 (8 and 32 in a smoke run): its rows emitted, its goal
    appended to `goals`; returns the line that sums them up.

    Each is a difference of two lengths, so prefill cancels out; the prompt ends where the measured tokens,
    `short`..`long_` after it, are centred on the position. All four calls share the same interleaved rounds, so
    a change in machine speed hits both positions alike.
    """
    positions, short, long_ = ((50, 500), 16, 48) if not smoke else ((8, 32), 2, 6)
    prompt_lengths = {position: position - (short + long_) // 2 for position in positions}
    calls = {}
    for position in positions:
        prompt = rng.integers(4, vocab, size=(1, prompt_lengths[position])).astype("int32")
        for n in (short, long_):
            calls[(position, n)] = (lambda prompt=prompt, n=n: generation.generate_ids(
                ours, prompt, n, jit_compile=True, end_id=-1).numpy())
    # A difference of two short runs is noisy: twelve times the rounds (each call is only tens of ms).
    times = common.interleaved(calls, repeats=12 * repeats, warmup=1)
    per_token = {}
    for position in positions:
        per_token[position] = (common.median(times[(position, long_)]) - common.median(times[(position, short)])) / (
            long_ - short)
        common.emit({"bench": "per_token", "system": "tfformer xla=True", "position": position,
                     "prompt_length": prompt_lengths[position], "new_tokens": [short, long_],
                     "ms_per_token": round(per_token[position] * 1000, 3)})
    # No per-round form for this one: a round's difference of two short calls can be ~0 or negative, so only the
    # ratio of the medians means something.
    per_token_ratio = per_token[positions[1]] / per_token[positions[0]]
    common.emit({"bench": "per_token_ratio", "positions": list(positions), "ratio": common.significant(per_token_ratio),
                 "rounds": len(times[(positions[0], short)])})
    goals.append(common.goal(f"per-token time at {positions[1]} <= 1.5x at {positions[0]}", per_token_ratio, 1.5,
                             at_least=False, rows=["tfformer xla=True"]))
    return (f"per-token time at {positions[1]} / at {positions[0]} = {per_token_ratio:.2f} "
            f"({len(times[(positions[0], short)])} rounds)")


def _after_idle(call):
    """`call` (self-timed) after `COLD_IDLE_SECONDS` of sleep: the cores idle, then the timed call."""

    def cold_call():
        time.sleep(COLD_IDLE_SECONDS)
        return call()

    return cold_call


if __name__ == "__main__":
    main()
