"""Loads a SavedModel the way TF Serving does: only tensorflow and tensorflow_text, no tfformer.

usage: fresh_process.py SAVED_MODEL_DIR INPUT_JSON OUTPUT_NPZ
INPUT_JSON maps signature name -> {input name: [values, dtype]}.
"""

import json
import sys

import numpy as np
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the tokenizer ops)

assert "tfformer" not in sys.modules
path, request_path, out_path = sys.argv[1:4]
loaded = tf.saved_model.load(path)
outputs = {}
for signature, inputs in json.load(open(request_path)).items():
    fn = loaded.signatures[signature]
    feed = {}
    for name, (value, dtype) in inputs.items():
        feed[name] = (tf.constant([v.encode("latin-1") for v in value]) if dtype == "bytes"
                      else tf.constant(value, dtype))
    for key, tensor in fn(**feed).items():
        outputs[f"{signature}/{key}"] = tensor.numpy()
assert "tfformer" not in sys.modules
np.savez(out_path, **outputs)
