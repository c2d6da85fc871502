# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # From `model.fit` to TF Serving and TFLite
#
# A small English→German translator is trained, then shipped three ways:
#
# 1. a **SavedModel** in TF Serving's layout (`base_path/<version>/`) whose `serving_default` signature takes raw
#    strings and returns translations (tokenizer and decoding loop inside the graph);
# 2. **served** by `tfformer serve`'s server (TF Serving's REST and gRPC APIs), queried over both;
# 3. converted to **TFLite** (float32, float16 and dynamic-range int8), compared on size, latency and accuracy.
#
# `TFFORMER_QUICK=1` trains for a few steps only; every equality below still holds.

# %%
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import json
import shutil
import tempfile
import time
import urllib.request

import keras
import numpy as np
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the tokenizer ops the SavedModel uses)

from tfformer import data, export, models, training

QUICK = os.environ.get("TFFORMER_QUICK") == "1"
if QUICK:
    SETTINGS = dict(train_pairs=1500, vocabulary_size=600, max_length=16, epochs=2, steps_per_epoch=8,
                    time_budget="1m", eval_examples=32,
                    model=dict(hidden_dim=32, num_heads=2, intermediate_dim=64, num_encoder_layers=1,
                               num_decoder_layers=1))
else:
    SETTINGS = dict(train_pairs=30000, vocabulary_size=2000, max_length=24, epochs=20, steps_per_epoch=100,
                    time_budget="3m", eval_examples=256,
                    model=dict(hidden_dim=128, num_heads=4, intermediate_dim=512, num_encoder_layers=2,
                               num_decoder_layers=2))
keras.utils.set_random_seed(0)
work_dir = tempfile.mkdtemp(prefix="tfformer-04-")
print("artifacts in", work_dir)

# %% [markdown]
# ## Train a small translator (as in notebook 02, shorter)

# %%
splits = data.gettext_pairs("de")
train_pairs = splits["train"][: SETTINGS["train_pairs"]]
tokenizer = data.SubwordTokenizer.train([s for pair in train_pairs for s in pair], SETTINGS["vocabulary_size"])
max_length = SETTINGS["max_length"]


def fits(pairs):
    src = tokenizer.tokenize([s for s, _ in pairs]).row_lengths().numpy()
    tgt = tokenizer.tokenize([t for _, t in pairs]).row_lengths().numpy()
    return [p for p, a, b in zip(pairs, src, tgt) if a <= max_length and b + 1 <= max_length]


train_pairs, validation_pairs = fits(train_pairs), fits(splits["validation"])
config = models.get_preset("transformer-tiny", vocabulary_size=tokenizer.vocabulary_size, max_sequence_length=64,
                           **SETTINGS["model"])
model = models.build_model(config)
model.compile(optimizer=training.transformer_optimizer(config.hidden_dim, warmup_steps=100 if QUICK else 400),
              loss=training.MaskedSparseCrossEntropy(0.1), metrics=[training.MaskedAccuracy()])
history = model.fit(
    data.make_translation_dataset(train_pairs, tokenizer, 32, max_length).repeat(),
    epochs=SETTINGS["epochs"], steps_per_epoch=SETTINGS["steps_per_epoch"],
    callbacks=[training.TimeBudget(SETTINGS["time_budget"])], verbose=2,
)
sentences = ["File not found", "Permission denied", "Could not open file"]
# jit_compile=False: the decoding graph the SavedModel holds (no XLA), so local and served outputs compare exactly.
# The task's `translate` protects placeholders (printf conversions, tags, edge whitespace) as the SavedModel does.
model.preprocessor = tokenizer
local = model.translate(sentences, max_new_tokens=max_length, jit_compile=False)
for s, t in zip(sentences, local):
    print(f"{s!r} -> {t!r}")

# %% [markdown]
# ## 1. SavedModel for TF Serving
#
# `tfformer.export.saved_model` writes version `1` under the base path. Its signatures: `serving_default`
# (`text` → `translation`), `predict_ids` (ids → logits) and `generate_ids` (ids → ids).

# %%
base_path = os.path.join(work_dir, "en-de")
version_dir = export.saved_model(model, base_path, tokenizer=tokenizer, max_new_tokens=max_length)
print(version_dir, sorted(os.listdir(version_dir)))

loaded = tf.saved_model.load(version_dir)
print({name: list(fn.structured_outputs) for name, fn in loaded.signatures.items()})
serving_default = loaded.signatures["serving_default"]
saved_model_out = [t.decode() for t in serving_default(text=tf.constant(sentences))["translation"].numpy()]
saved_model_out

# %% [markdown]
# ## 2. `tfformer serve`
#
# On the command line this is
#
# ```
# tfformer serve --model_name en-de --model_base_path <base_path> --port 8500 --rest_api_port 8501
# ```
#
# (the same flags as `tensorflow_model_server`, which can serve the same directory). Here we start the same
# server in this process on free ports, with `tfformer.serving.Server`.

# %%
from tfformer import serving  # noqa: E402

server = serving.Server(model_name="en-de", model_base_path=base_path, port=0, rest_api_port=0)
server.start()
print("REST", server.rest_url, " gRPC", server.grpc_url)

# %% [markdown]
# **REST**: TF Serving's JSON API, by hand with `urllib` (row format: one instance per sentence).

# %%
request = urllib.request.Request(
    f"{server.rest_url}/v1/models/en-de:predict",
    data=json.dumps({"instances": sentences}).encode(),
    headers={"Content-Type": "application/json"},
)
with urllib.request.urlopen(request, timeout=60) as reply:
    rest_reply = json.loads(reply.read())
print(json.dumps(rest_reply, ensure_ascii=False))
with urllib.request.urlopen(f"{server.rest_url}/v1/models/en-de", timeout=60) as reply:
    print(json.loads(reply.read()))
rest_out = rest_reply["predictions"]

# %% [markdown]
# **gRPC**: `tensorflow_serving.apis` `PredictRequest` through `tfformer.serving.Client` (which speaks both
# protocols; `Client(server.rest_url)` would send the JSON above).

# %%
with serving.Client(server.grpc_url) as client:
    grpc_reply = client.predict("en-de", sentences)
grpc_out = [t.decode() for t in grpc_reply["translation"]]
with serving.Client(server.rest_url) as client:
    ids_reply = client.predict("en-de", {"encoder_token_ids": tokenizer.tokenize(sentences[:1]).to_tensor().numpy(),
                                         "decoder_token_ids": np.array([[data.START_ID]], np.int32)},
                               signature_name="predict_ids")
print("gRPC:", grpc_out)
print("REST predict_ids logits:", ids_reply["logits"].shape)

# %%
server.stop()

# %% [markdown]
# ## 3. TFLite: size, latency, accuracy
#
# `tfformer.export.tflite` converts the token-id model (`predict_ids`, builtin ops only) with a fixed sequence
# length. Three variants: float32, float16 weights, and dynamic-range quantization (int8 weights, float
# activations). Accuracy is next-token accuracy (teacher forcing) on validation pairs; *agreement* is how often
# the file's argmax equals the Keras model's.

# %%
from ai_edge_litert.interpreter import Interpreter  # noqa: E402


def pad(rows, length):
    out = np.zeros((len(rows), length), np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


eval_pairs = validation_pairs[: SETTINGS["eval_examples"]]
src = tokenizer.tokenize([s for s, _ in eval_pairs]).to_list()
tgt = tokenizer.tokenize([t for _, t in eval_pairs]).to_list()
eval_inputs = {"encoder_token_ids": pad(src, max_length),
               "decoder_token_ids": pad([[data.START_ID] + t for t in tgt], max_length)}
eval_labels = pad([t + [data.END_ID] for t in tgt], max_length)
keep = eval_labels != 0
keras_logits = model.predict(eval_inputs, batch_size=32, verbose=0)
keras_argmax = keras_logits.argmax(-1)


def evaluate(run, batch=16):
    logits = np.concatenate([run({k: v[i : i + batch] for k, v in eval_inputs.items()})
                             for i in range(0, len(eval_labels), batch)])
    one = {k: v[:1] for k, v in eval_inputs.items()}
    run(one)  # warm-up
    times = []
    for _ in range(10 if QUICK else 30):
        t = time.perf_counter()
        run(one)
        times.append(time.perf_counter() - t)
    argmax = logits.argmax(-1)
    return dict(latency_ms=1000 * float(np.median(times)),
                accuracy=float((argmax == eval_labels)[keep].mean()),
                agreement=float((argmax == keras_argmax)[keep].mean()),
                max_abs_diff=float(np.abs(logits - keras_logits)[keep].max()))


def size_mb(path):
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files) / 2**20
    return os.path.getsize(path) / 2**20


rows = {"Keras (SavedModel)": dict(size_mb=size_mb(version_dir),
                                   **evaluate(lambda inputs: model.predict_on_batch(inputs)))}
for quantize in (None, "float16", "dynamic"):
    name = f"TFLite {quantize or 'float32'}"
    path = os.path.join(work_dir, f"en-de-{quantize or 'float32'}.tflite")
    t = time.monotonic()
    export.tflite(model, path, quantize=quantize, sequence_length=max_length)
    runner = Interpreter(model_path=path, num_threads=2).get_signature_runner("predict_ids")
    rows[name] = dict(size_mb=size_mb(path), **evaluate(lambda inputs: runner(**inputs)["logits"]))
    print(f"{name}: converted in {time.monotonic() - t:.0f}s")

print(f"\n{'':20s} {'size MB':>8s} {'latency ms':>11s} {'accuracy':>9s} {'agreement':>10s} {'max |Δlogit|':>13s}")
for name, row in rows.items():
    print(f"{name:20s} {row['size_mb']:8.2f} {row['latency_ms']:11.2f} {row['accuracy']:9.3f} "
          f"{row['agreement']:10.3f} {row['max_abs_diff']:13.2e}")

# %% [markdown]
# The SavedModel's size includes the tokenizer and the decoding loop; the TFLite files hold the id model only.
# Dynamic-range quantization stores weights in int8 (about 4× smaller than float32) at a small accuracy cost.

# %% [markdown]
# ## Check: what this notebook teaches

# %%
assert saved_model_out == local, "the SavedModel translates differently from the Keras model"
assert rest_out == local, "the REST prediction differs from the local one"
assert grpc_out == local, "the gRPC prediction differs from the local one"
assert np.allclose(ids_reply["logits"], model.predict_on_batch(
    {"encoder_token_ids": tokenizer.tokenize(sentences[:1]).to_tensor(),
     "decoder_token_ids": np.array([[data.START_ID]], np.int32)}), atol=1e-4)
assert rows["TFLite float32"]["max_abs_diff"] < 1e-3 and rows["TFLite float32"]["agreement"] > 0.99
assert rows["TFLite dynamic"]["size_mb"] < rows["TFLite float32"]["size_mb"]
assert rows["TFLite float16"]["size_mb"] < rows["TFLite float32"]["size_mb"]
if not QUICK:  # (the quick model is so small that most of its tensors stay float: too small to quantize)
    assert rows["TFLite dynamic"]["size_mb"] < 0.4 * rows["TFLite float32"]["size_mb"]
    assert rows["TFLite float16"]["size_mb"] < 0.6 * rows["TFLite float32"]["size_mb"]
    for name in ("TFLite float16", "TFLite dynamic"):
        assert rows[name]["accuracy"] > rows["TFLite float32"]["accuracy"] - 0.02, (name, rows[name])
shutil.rmtree(work_dir, ignore_errors=True)
print("all checks passed")
