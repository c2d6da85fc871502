"""tfformer: Transformers as clean Keras 3 layers, from `model.fit` to TF Serving and TFLite."""

from tfformer import convert, layers, models
from tfformer.version import __version__

__all__ = ["convert", "layers", "models", "__version__"]
