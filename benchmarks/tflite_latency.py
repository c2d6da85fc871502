"""Batch-1 latency of the same model as a SavedModel (predict_ids) and as TFLite (ai_edge_litert), same threads.

Both run on as many threads as the cores this process may use (`common.cores()`): TensorFlow's intra-op threads
are set to that count (its default) and each LiteRT interpreter gets `num_threads` of it; each row records it.
The model is `gpt-mini` (random weights, dropout off), 64 token ids in, logits out; 20 interleaved rounds.

    python -m benchmarks.tflite_latency [--smoke]
"""

import argparse
import os
import tempfile

import numpy as np
import tensorflow as tf
from ai_edge_litert.interpreter import Interpreter

from benchmarks import common
from tfformer import export, models


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    threads = common.cores()  # the interpreters get as many; "same threads" for the goal
    if not common.set_tf_threads(threads):
        raise RuntimeError(f"TensorFlow already runs {tf.config.threading.get_intra_op_parallelism_threads()} "
                           f"intra-op threads; the interpreters would get {threads}. Run the benchmark in a fresh "
                           f"process.")
    overrides = (dict(num_decoder_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32, vocabulary_size=64)
                 if args.smoke else {})
    model = models.from_preset("gpt-mini", dropout=0.0, **overrides)
    length = 8 if args.smoke else 64
    ids = np.random.default_rng(0).integers(4, model.config.vocabulary_size, size=(1, length)).astype("int32")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # The ids signature alone: the text signatures need a tokenizer and are not what TFLite replaces.
        saved = tf.saved_model.load(_ids_only_saved_model(model, os.path.join(tmp, "sm")))
        serve = saved.signatures["predict_ids"]
        calls = {"saved_model": lambda: serve(token_ids=tf.constant(ids))["logits"].numpy()}
        for quantize in (None, "dynamic"):
            for batch_size in (None, 1):  # dynamic batch, and every shape static
                path = export.tflite(model, os.path.join(tmp, f"{quantize}-{batch_size}.tflite"), quantize=quantize,
                                     sequence_length=length, batch_size=batch_size)
                runner = Interpreter(model_path=path, num_threads=threads).get_signature_runner("predict_ids")
                name = f"tflite {quantize or 'float32'}" + (" batch=1 static" if batch_size else "")
                calls[name] = lambda runner=runner: runner(token_ids=ids)["logits"]
        times = common.interleaved(calls, repeats=1 if args.smoke else 20, warmup=2)
    base = common.median(times["saved_model"])
    for name, values in times.items():
        # Latency ratio (< 1: faster than the SavedModel); per round: this file's time / the SavedModel's.
        per_round = common.paired_ratio(times["saved_model"], values)
        rows.append(common.emit({"bench": "latency_batch1", "system": name,
                                 "ms": round(common.median(values) * 1000, 2),
                                 "ratio_vs_saved_model": round(common.median(values) / base, 2),
                                 "threads": threads,
                                 "per_round": [common.significant(x) for x in per_round]}))
    print()
    table_rows = [dict(r, per_round=common.ratio_text(r["per_round"])) for r in rows]
    print(common.table(table_rows, ["system", "ms", "ratio_vs_saved_model", "per_round"]))
    # The issue's: the same model (float32, not quantized), same threads, TFLite at most 0.6x the SavedModel's.
    goal = common.goal("tflite batch-1 latency <= 0.6x the SavedModel's",
                       common.median(times["tflite float32"]) / base, 0.6, at_least=False,
                       rows=["tflite float32", "saved_model"])
    common.print_goals([goal], "Goal (ratio of the medians):")


def _ids_only_saved_model(model, path):
    import keras

    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("predict_ids", lambda inputs: {"logits": model(inputs)},
                         input_signature=[{"token_ids": tf.TensorSpec([None, None], tf.int32, name="token_ids")}])
    archive.write_out(path, verbose=False)
    return path


if __name__ == "__main__":
    main()
