"""tfformer's training systems in a process of their own, with one intra-op thread per micro-batch.

`training.configure_cpu_threads` sets TensorFlow's intra-op threads for the whole process, before its runtime
starts; keras-hub and tfformer's other rows run in the benchmark's process with TensorFlow's default (as many
threads as cores), keras-hub's faster setting (docs/performance.md, "Training: CPU threads"). So these
rows come from a worker process, interleaved with the others as the PyTorch worker is (`torch_worker`'s
protocol: the worker builds its systems and prints `{"ready": ...}`, each line it reads, `float32` or
`bfloat16`, runs `steps` training steps and it prints `{"seconds": ...}`; `quit` ends it).

Systems: `train_seq2seq` and `train_lm`, the tfformer float32 and mixed_bfloat16 models of `benchmarks.training`
(`tfformer_seq2seq`, `tfformer_lm`: `FusedAdam`, tfformer's loss, no metrics, `micro_batches=MICRO_BATCHES`) on
the benchmark's token ids, after `training.configure_cpu_threads(MICRO_BATCHES)`.
"""

import json
import os
import sys
import time

if __name__ == "__main__":  # started as a script (`TorchWorker`): the repository, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common, torch_worker


def worker_main(system, spec):
    from tfformer import training as tfformer_training

    threads = tfformer_training.configure_cpu_threads(spec["micro_batches"])  # before anything makes a tensor
    import keras

    from benchmarks import training

    ids = torch_worker.load_arrays(spec["arrays"])["ids"]
    if system == "train_seq2seq":
        build, x, y = training.tfformer_seq2seq, {"encoder_token_ids": ids, "decoder_token_ids": ids}, ids
    else:
        build, x, y = training.tfformer_lm, {"token_ids": ids[:, :-1]}, ids[:, 1:]
    models = {}
    for dtype, policy in (("float32", "float32"), ("bfloat16", "mixed_bfloat16")):
        keras.config.set_dtype_policy(policy)
        models[dtype] = build(spec["shape"])
        if models[dtype].micro_batches != spec["micro_batches"]:
            raise RuntimeError(f"{system} {dtype} compiled with {models[dtype].micro_batches} micro-batches, "
                               f"not {spec['micro_batches']}")
        models[dtype].train_on_batch(x, y)  # trace
    keras.config.set_dtype_policy("float32")
    print(json.dumps({"ready": True, "intra_op_threads": threads, "parameters": models["float32"].count_params(),
                      "micro_batches": spec["micro_batches"]}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        start = time.perf_counter()
        for _ in range(spec["steps"]):
            models[command].train_on_batch(x, y)
        torch_worker.reply(time.perf_counter() - start)


def start(system, spec, ids):
    """A `torch_worker.Pending` for `system` (`train_seq2seq` or `train_lm`) in this interpreter; `spec` holds the
    `shape`, `steps` and `micro_batches`, `ids` the benchmark's token ids."""
    spec = dict(spec, threads=common.cores())
    try:
        return torch_worker.Pending(torch_worker.TorchWorker(sys.executable, system, spec, {"ids": ids},
                                                             script=os.path.abspath(__file__)))
    except OSError as error:
        return torch_worker.Pending(skipped=f"the tfformer worker did not start: {error}")


if __name__ == "__main__":
    worker_main(sys.argv[1], json.loads(sys.argv[2]))
