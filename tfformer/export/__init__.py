"""Turn a trained model into artifacts: TF-Serving SavedModels and TFLite files."""

from tfformer.export.saved_model import saved_model
from tfformer.export.tflite import tflite, tflite_decoder

__all__ = ["saved_model", "tflite", "tflite_decoder"]
