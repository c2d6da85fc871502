"""On-device runtime: drive a tfformer .tflite decoder with ai_edge_litert (no TensorFlow model code)."""

from tfformer.edge.generator import Generator

__all__ = ["Generator"]
