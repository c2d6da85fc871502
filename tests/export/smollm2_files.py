"""Writes SmolLM2-135M-Instruct's float32, dynamic-range int8 and GGUF-exact int8 TFLite decoders, in a process of
its own: the converter's peak (several GB for the 135M model) is given back to the machine when it exits, instead
of staying in a pytest worker for the rest of the suite.

    python -m tests.export.smollm2_files OUT_DIR MAX_LENGTH

Writes OUT_DIR/{float32,dynamic,gguf}.tflite and OUT_DIR/weights.json (the float32 weights' bytes).
"""

import json
import os
import sys

import numpy as np

from tfformer import export, models
from tfformer.export import exact_int8


def main(directory, max_length):
    model = models.from_preset("smollm2-135m-instruct")
    files = {name: os.path.join(directory, f"{name}.tflite") for name in ("float32", "dynamic", "gguf")}
    for name, quantize in (("float32", None), ("dynamic", "dynamic")):
        export.tflite_decoder(model, files[name], max_length=max_length, quantize=quantize)
    # What `quantize="gguf"` writes (test_exact_int8 checks it is the same bytes), from the float32 file already
    # made: one converter run less.
    exact_int8.requantize_blocks(files["float32"], files["gguf"],
                                 input_scales=[np.asarray(w) for w in model.weights if len(w.shape) == 1])
    with open(os.path.join(directory, "weights.json"), "w") as f:
        json.dump({"bytes": int(sum(np.asarray(w).nbytes for w in model.weights))}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
