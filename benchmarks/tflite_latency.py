"""Batch-1 latency of the same model as a SavedModel (predict_ids) and as TFLite (ai_edge_litert), same threads.

Both run on as many threads as the cores this process may use (`common.cores()`): TensorFlow's intra-op threads
are set to that count (its default) and each LiteRT interpreter gets `num_threads` of it; each row records it.
The model is `gpt-mini` (random weights, dropout off), 64 token ids in, logits out; 20 interleaved rounds.
Then `edge_decode_rows`: the decode tokens/s of `tfformer.edge.Generator` on default decoder files.

    python -m benchmarks.tflite_latency [--smoke]
"""

import argparse
import functools
import os
import tempfile

import numpy as np
import tensorflow as tf
from ai_edge_litert.interpreter import Interpreter

from benchmarks import common
from tfformer import export, models
from tfformer.tokens import START_ID


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
    with tempfile.TemporaryDirectory() as tmp:
        rows = edge_decode_rows(threads, args.smoke, tmp)
    print()
    print(common.table([dict(r, per_round=common.ratio_text(r["per_round"])) for r in rows],
                       ["model", "system", "cache_slots", "tokens", "tokens_per_s", "speedup", "per_round"]))


def edge_decode_rows(threads, smoke, directory):
    """Decode tokens/s of `tfformer.edge.Generator` (LiteRT's CompiledModel, the cache in its buffer) on decoder
    files as `tfformer.export.tflite_decoder` writes them by default (a cache of `max_sequence_length` slots): the
    translator `transformer-tiny` (greedy) and `gpt-mini`, random weights, against the host loop that copies the
    cache through numpy at every step (an `Interpreter` signature runner, the `Generator` of 36b9357 and
    before) on the same file and the same tokens. tokens/s: new tokens over the call's time, `gpt-mini`'s 6-token
    prompt (fed one step a token) included."""
    from tfformer import edge

    overrides = dict(hidden_dim=16, num_heads=2, intermediate_dim=32, vocabulary_size=64, max_sequence_length=16)
    rows = []
    for preset in ("transformer-tiny", "gpt-mini"):
        model = models.from_preset(preset, dropout=0.0, **(overrides if smoke else {}))
        path = export.tflite_decoder(model, os.path.join(directory, f"{preset}.tflite"))
        generator = edge.Generator(path, num_threads=threads)
        prompt = [5, 6, 7, 8, 9, 10]
        room = generator.max_length - (0 if generator.is_seq2seq else len(prompt))
        if generator.is_seq2seq:  # stops at the end id, if chosen
            decode = functools.partial(generator.translate, prompt, max_new_tokens=room)
        else:
            decode = functools.partial(generator.generate, prompt, max_new_tokens=room, end_ids=())
        tokens = decode()
        fed = ([START_ID] + tokens[:-1]) if generator.is_seq2seq else prompt + tokens[:-1]
        copying = _copying_loop(path, threads, prompt, fed)
        assert copying() == tokens, "the copying loop and edge.Generator chose different tokens"
        calls = {"edge.Generator": decode, "Interpreter, cache copied": copying}
        times = common.interleaved(calls, repeats=1 if smoke else 10, warmup=1)
        base = times["Interpreter, cache copied"]
        for name, values in times.items():
            rows.append(common.emit({
                "bench": "edge_decode", "model": preset, "system": name, "cache_slots": generator.max_length,
                "tokens": len(tokens), "tokens_per_s": round(len(tokens) / common.median(values), 1),
                "threads": threads, "speedup": round(common.median(base) / common.median(values), 2),
                "per_round": [common.significant(x) for x in common.paired_ratio(values, base)]}))
    return rows


def _copying_loop(path, threads, prompt, fed):
    """A callable that feeds `fed` (every step's input token, a causal LM's prompt first) to an `Interpreter`, the
    caches copied in and out of each step, and returns the greedy choices after the prompt: the loop before the
    CompiledModel one."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path, num_threads=threads)
    step = interpreter.get_signature_runner("decode_step")
    shapes = {name: detail["shape"] for name, detail in step.get_input_details().items() if name.startswith("cache_")}
    seq2seq = "encode" in interpreter.get_signature_list()
    encode = interpreter.get_signature_runner("encode") if seq2seq else None
    if seq2seq:
        source = np.zeros((1, encode.get_input_details()["encoder_token_ids"]["shape"][1]), np.int32)
        source[0, : len(prompt)] = prompt

    def run():
        extra = encode(encoder_token_ids=source) if seq2seq else {}
        caches, chosen = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}, []
        start = 0 if seq2seq else len(prompt) - 1  # a causal LM's choices start after its whole prompt
        for index, token in enumerate(fed):
            out = step(token_ids=np.array([[token]], np.int32), index=np.array(index, np.int32), **caches, **extra)
            caches = {name: out[name] for name in shapes}
            if index >= start:
                chosen.append(int(np.argmax(out["logits"][0, -1])))
        return chosen

    return run


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
