"""tfformer: Transformers as clean Keras 3 layers, from `model.fit` to TF Serving and TFLite."""

from tfformer import convert, data, export, generation, layers, models, training
from tfformer.version import __version__

__all__ = ["convert", "data", "export", "generation", "layers", "models", "training", "__version__"]
