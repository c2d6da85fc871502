"""Example: a trained run -> SavedModel (TF Serving layout) + TFLite files under export/models/.

    python export/export_preset.py runs/demo-en-de-<time> en-de
"""

import sys

import tfformer.export
from tfformer.recipes import translation

run_dir, name = sys.argv[1], sys.argv[2]
model = translation.load_run(run_dir)
tokenizer = model.preprocessor
print(tfformer.export.saved_model(model, f"export/models/{name}", tokenizer=tokenizer))
print(tfformer.export.tflite(model, f"export/models/{name}/model.tflite", quantize="dynamic"))
print(tfformer.export.tflite_decoder(model, f"export/models/{name}/decoder.tflite", tokenizer=tokenizer))
