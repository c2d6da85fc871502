"""On-device runtimes: a tfformer .tflite decoder driven with ai_edge_litert (no TensorFlow model code), and a
.litertlm bundle in Google's LiteRT-LM runtime."""

from tfformer.edge.chat import Chat
from tfformer.edge.generator import Generator
from tfformer.edge.transcriber import Transcriber, log_mel_features

__all__ = ["Chat", "Generator", "Transcriber", "log_mel_features"]
