"""On-device runtime: drive a tfformer .tflite decoder with ai_edge_litert (no TensorFlow model code)."""

from tfformer.edge.generator import Generator
from tfformer.edge.transcriber import Transcriber, log_mel_features

__all__ = ["Generator", "Transcriber", "log_mel_features"]
