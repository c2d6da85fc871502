"""Turn a trained model into artifacts: TF-Serving SavedModels, TFLite files and LiteRT-LM bundles."""

from tfformer.export.litertlm import litertlm
from tfformer.export.saved_model import saved_model
from tfformer.export.tflite import tflite, tflite_decoder

__all__ = ["litertlm", "saved_model", "tflite", "tflite_decoder"]
