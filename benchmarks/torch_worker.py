"""The PyTorch systems of the benchmarks, each in a worker process of an interpreter that has torch.

The worker imports only the standard library, numpy, torch and transformers / sentence-transformers (never
TensorFlow or tfformer), so it runs in another interpreter: this one if it has the modules a system needs,
else the peers' `.venv-peers/bin/python` (`benchmarks.peers`; `make peers` installs it). The benchmark process
starts it with a system and a JSON spec, the worker builds the system and prints `{"ready": ...}`; then each
line it reads (`float32`, `bfloat16`, or for generation `float32 8`) runs the system once and it prints
`{"seconds": ...}`, the time of that run alone, without the pipe around it; `quit` ends it. The worker waits on
its pipe while the Keras systems run.

Systems (the spec's intra-op threads, 1 inter-op thread; bfloat16 is `torch.autocast("cpu", dtype=torch.bfloat16)`):
- `encoder`: sentence-transformers' `SentenceTransformer` of a checkpoint directory, one forward pass; with
  `encode float32` / `encode bfloat16`, `SentenceTransformer.encode` of the spec's `texts` (tokenization
  included, batches of 32).
- `train_lm`: transformers' `GPT2LMHeadModel` of the benchmark's shape (tied embeddings, dropout 0.1), the
  loss `F.cross_entropy` on float32 logits, `torch.optim.Adam(lr=1e-4, fused=True)`; `steps` steps per run.
- `train_seq2seq`: `torch.nn.Transformer` (post-norm, ReLU, dropout 0.1) between learned token + position
  embeddings and an untied output projection (keras-hub's seq2seq layout), the same loss and optimizer.
- `generate`: `GPT2LMHeadModel.generate`, greedy, KV cache, exactly `new_tokens` new tokens.
- `llm`: transformers' Llama model of SmolLM2-135M-Instruct, loaded from the spec's GGUF as a new user does
  (`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`, which dequantizes it to float32; with no `gguf_dir`,
  a random `LlamaForCausalLM` of the spec's `shape`, for smoke runs), and a copy in bfloat16
  (`model.to(torch.bfloat16)`: the weights themselves, so a decode step reads half the bytes, not autocast).
  `decode DTYPE N`: `generate` greedy with its KV cache, exactly N new tokens after the spec's `decode` prompt;
  `prefill DTYPE`: `generate` of one token after the `prefill` prompt (the time to the first token). The ready
  line also carries the peak memory after loading (`load_peak_rss_mb`), and each reply the new ids.
"""

import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

# A worker sleeps this long after each timed run before it replies: PyTorch's OpenMP threads (libgomp) spin for a
# few milliseconds after their last parallel region, on the cores the next system in the round is about to use.
# The parent waits on the pipe meanwhile; no system's time includes it.
SETTLE_SECONDS = 0.05


def peak_rss_mb():
    """This process's own peak: Linux's `VmHWM`. `ru_maxrss` would not do: it survives fork + exec, so a worker
    started by a process that held 4 GB reports at least 4 GB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _encoder(spec):
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(spec["model_dir"], device="cpu").eval()
    ids = torch.from_numpy(load_arrays(spec["arrays"])["ids"].astype("int64"))
    features = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}

    def run(command):
        *encode, dtype = command.split()
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            if encode:
                embedding = model.encode(spec["texts"], batch_size=32, convert_to_tensor=True)
            else:
                embedding = model(dict(features))["sentence_embedding"]
        float(embedding.float().sum())

    return model, run


def _gpt2(shape, max_length, dropout):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=shape["vocab"], n_positions=max_length, n_embd=shape["hidden"],
                        n_layer=shape["layers"], n_head=shape["heads"], n_inner=shape["intermediate"],
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=None,
                        eos_token_id=None, pad_token_id=0)
    return GPT2LMHeadModel(config)


def _seq2seq(shape):
    """keras-hub's seq2seq layout in PyTorch: learned token + position embeddings, `nn.Transformer`, untied output."""
    import torch
    from torch import nn

    class Seq2Seq(nn.Module):
        def __init__(self, s):
            super().__init__()
            d = s["hidden"]
            self.source, self.target = nn.Embedding(s["vocab"], d), nn.Embedding(s["vocab"], d)
            self.source_position = nn.Parameter(torch.randn(s["length"], d) * 0.02)
            self.target_position = nn.Parameter(torch.randn(s["length"], d) * 0.02)
            self.core = nn.Transformer(d, s["heads"], s["layers"], s["layers"], s["intermediate"], dropout=0.1,
                                       batch_first=True)
            self.output = nn.Linear(d, s["vocab"])

        def forward(self, source, target):
            t = target.shape[1]
            causal = nn.Transformer.generate_square_subsequent_mask(t)  # (T, T)
            hidden = self.core(self.source(source) + self.source_position[: source.shape[1]],
                               self.target(target) + self.target_position[:t], tgt_mask=causal, tgt_is_causal=True)
            return self.output(hidden)  # (B, T, V)

    return Seq2Seq(shape)


def _trainer(model, forward, labels, steps):
    import torch
    import torch.nn.functional as F

    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    def run(dtype):
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                logits = forward()
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())  # mean over tokens
            loss.backward()
            optimizer.step()
        float(loss.detach())

    return run


def _train_lm(spec):
    import torch

    arrays = load_arrays(spec["arrays"])
    inputs, labels = (torch.from_numpy(arrays[k].astype("int64")) for k in ("inputs", "labels"))
    model = _gpt2(spec["shape"], spec["shape"]["length"], dropout=0.1)
    return model, _trainer(model, lambda: model(input_ids=inputs).logits, labels, spec["steps"])


def _train_seq2seq(spec):
    import torch

    arrays = load_arrays(spec["arrays"])
    source, target, labels = (torch.from_numpy(arrays[k].astype("int64")) for k in ("source", "target", "labels"))
    model = _seq2seq(spec["shape"])
    return model, _trainer(model, lambda: model(source, target), labels, spec["steps"])


def _generate(spec):
    import torch

    model = _gpt2(spec["shape"], spec["max_length"], dropout=0.0).eval()
    prompts = {name: torch.from_numpy(ids.astype("int64"))  # batch_B
               for name, ids in load_arrays(spec["arrays"]).items()}
    new_tokens = spec["new_tokens"]

    def run(command):
        dtype, batch = command.split()
        prompt = prompts[f"batch_{batch}"]
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False)
        if out.shape[1] != prompt.shape[1] + new_tokens:
            raise RuntimeError(f"generate made {out.shape[1] - prompt.shape[1]} tokens, not {new_tokens}")

    return model, run


def _llm(spec):
    import torch

    if spec.get("gguf_dir"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(spec["gguf_dir"], gguf_file=spec["gguf_file"],
                                                     dtype=torch.float32)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        s = spec["shape"]
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
            max_position_embeddings=s["max_length"], rms_norm_eps=1e-5, rope_theta=100000.0,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0))
    spec["load_peak_rss_mb"] = round(peak_rss_mb())  # before the bfloat16 copy: what loading alone took
    models = {"float32": model.eval()}
    models["bfloat16"] = copy.deepcopy(model).to(torch.bfloat16).eval()
    prompts = {name: torch.from_numpy(ids.astype("int64")) for name, ids in load_arrays(spec["arrays"]).items()}

    def run(command):
        kind, dtype, *count = command.split()
        prompt = prompts[kind]
        new_tokens = int(count[0]) if kind == "decode" else 1
        with torch.inference_mode():
            out = models[dtype].generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if out.shape[1] != prompt.shape[1] + new_tokens:
            raise RuntimeError(f"generate made {out.shape[1] - prompt.shape[1]} tokens, not {new_tokens}")
        return {"ids": out[0, prompt.shape[1]:].tolist()}

    return model, run


SYSTEMS = {"encoder": _encoder, "train_lm": _train_lm, "train_seq2seq": _train_seq2seq, "generate": _generate,
           "llm": _llm}
# train_seq2seq needs only torch, but asks for what train_lm does: both workloads of a run then use one install.
MODULES = {"encoder": ("torch", "sentence_transformers"), "train_lm": ("torch", "transformers"),
           "train_seq2seq": ("torch", "transformers"), "generate": ("torch", "transformers"),
           "llm": ("torch", "transformers", "gguf")}


def load_arrays(path):
    """`{name: array}` of the .npz file at `path` (the `arrays` a `TorchWorker` was given), read whole."""
    import numpy as np

    with np.load(path) as arrays:
        return {name: arrays[name] for name in arrays.files}


def worker_main(system, spec):
    import torch

    torch.set_num_threads(spec["threads"])
    torch.set_num_interop_threads(1)
    torch.manual_seed(0)
    model, run = SYSTEMS[system](spec)
    parameters = sum(p.numel() for p in model.parameters())
    ready = {"ready": True, "torch": torch.__version__, "threads": torch.get_num_threads(), "parameters": parameters}
    if "load_peak_rss_mb" in spec:
        ready["load_peak_rss_mb"] = spec["load_peak_rss_mb"]
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        start = time.perf_counter()
        extra = run(command)
        reply(time.perf_counter() - start, **(extra or {}))


def reply(seconds, **extra):
    """A worker's answer to one timed command: its `seconds` and the process's peak memory, after
    `SETTLE_SECONDS` (its threads go idle before the next system in the round starts); `extra` (JSON values,
    e.g. the ids a run produced) rides along."""
    time.sleep(SETTLE_SECONDS)
    print(json.dumps({"seconds": seconds, "peak_rss_mb": round(peak_rss_mb()), **extra}), flush=True)


# === The benchmark process's side ===


def _has_modules(python, modules):
    """Whether `python` can import `modules` (found, not imported: no torch start-up)."""
    code = f"import importlib.util, sys; sys.exit(not all(importlib.util.find_spec(m) for m in {list(modules)!r}))"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_python(modules, explicit=None, option="--torch-python"):
    """`(python, None)`: `explicit` (given as `option`), else this interpreter, else the peers'
    (`benchmarks.peers.python()`), whichever has `modules`; `(None, why)` if none does."""
    import importlib.util

    from benchmarks import peers

    needs = " + ".join(modules)
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            return None, f"{option} {explicit!r} is not an executable file"
        if not _has_modules(explicit, modules):
            return None, f"{option} {explicit!r} lacks {needs}"
        return explicit, None
    if all(importlib.util.find_spec(m) for m in modules):
        return sys.executable, None
    peer = peers.python()
    if peer is not None and _has_modules(peer, modules):
        return peer, None
    return None, f"no interpreter with {needs}: not this one, nor {peers.describe('python')}"


def torch_python(system, explicit=None):
    """`find_python` of the modules that `system` needs (`MODULES`)."""
    return find_python(MODULES[system], explicit)


def add_python_option(parser, system):
    """`--torch-python` on a benchmark's parser; its help names the modules `system` needs (`MODULES`)."""
    from benchmarks import peers

    needs = " + ".join(MODULES[system])
    parser.add_argument("--torch-python", help=f"interpreter with {needs} for the PyTorch rows (default: this one "
                        f"if it has them, else {peers.describe('python')})")


class TorchWorker:
    """One PyTorch system in a worker process. `arrays` (numpy, by name) reach it through an .npz file.

    `script`: the worker's program, this file by default (`keras_worker` runs tfformer systems with the same
    protocol)."""

    def __init__(self, python, system, spec, arrays, script=None):
        import numpy as np

        self.name = "PyTorch" if script is None else os.path.splitext(os.path.basename(script))[0]
        self.closed = False
        self.info = None
        self.peak_rss_mb = None
        self.last_reply = None  # the whole reply of the last `run`: its seconds, peak memory and any extras
        self.log = tempfile.TemporaryFile(mode="w+")
        self._arrays = tempfile.NamedTemporaryFile(suffix=".npz", delete=False)
        self.proc = None
        try:
            np.savez(self._arrays, **arrays)
            self._arrays.close()
            spec = dict(spec, arrays=self._arrays.name)
            self.proc = subprocess.Popen(
                [python, script or os.path.abspath(__file__), system, json.dumps(spec)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                env=dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false"),
            )
        except BaseException:
            self.close()
            raise

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"{self.name} worker died:\n{self.log.read()[-3000:]}")
        return json.loads(line)

    def wait_ready(self):
        self.info = self._read()
        return self.info

    def run(self, command):
        """Seconds of one run of `command` (e.g. "float32"), timed inside the worker."""
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        reply = self.last_reply = self._read()
        self.peak_rss_mb = reply["peak_rss_mb"]
        return reply["seconds"]

    def close(self):
        """Stop the worker and delete its files; safe to call again."""
        if self.closed:
            return
        self.closed = True
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        self._arrays.close()
        if os.path.exists(self._arrays.name):
            os.unlink(self._arrays.name)


class Pending:
    """A PyTorch system being built in its worker process, or the reason there is none (`skipped`); `label`
    names the system's library in what `ready` prints.

    A context manager: leaving it closes the worker. Start it before the Keras systems are built, so the
    worker loads meanwhile, and call `ready()` when the PyTorch rows are wanted.
    """

    def __init__(self, worker=None, skipped=None, label="PyTorch"):
        self.worker, self.skipped, self.label = worker, skipped, label

    def ready(self):
        """The `TorchWorker` once it has built its system; None, after printing why, if there are no PyTorch rows."""
        if self.worker is not None and self.worker.info is None:
            try:
                self.worker.wait_ready()
            except RuntimeError as error:
                self.worker.close()
                self.worker, self.skipped = None, f"the {self.label} worker failed: {str(error)[-500:]}"
        if self.worker is None:
            print(f"{self.label} rows skipped: {self.skipped}", flush=True)
        return self.worker

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if self.worker is not None:
            self.worker.close()


def start(system, spec, arrays, explicit_python=None):
    """A `Pending` worker for `system`, or one that says why there is none (no interpreter has the modules, or the
    worker did not start). `spec["threads"]` is the worker's intra-op thread count."""
    python, why = torch_python(system, explicit_python)
    if python is None:
        return Pending(skipped=why)
    try:
        return Pending(TorchWorker(python, system, spec, arrays))
    except OSError as error:
        return Pending(skipped=f"the PyTorch worker did not start: {error}")


if __name__ == "__main__":
    worker_main(sys.argv[1], json.loads(sys.argv[2]))
