"""What every tfformer model shares: config handling and the embedding stack."""

import keras

from tfformer import layers
from tfformer.layers import masks
from tfformer.models.config import TransformerConfig


def as_config(config):
    if isinstance(config, TransformerConfig):
        return config
    if isinstance(config, dict):
        return TransformerConfig.from_dict(config)
    raise ValueError(f"`config` must be a TransformerConfig or a dict. Received: config={config!r}")


def kernel_initializer(config):
    if config.initializer_range is None:
        return "glorot_uniform"
    return keras.initializers.TruncatedNormal(stddev=config.initializer_range)


def token_ids_input(name):
    return keras.Input(shape=(None,), dtype="int32", name=name)


def padding_mask_of(token_ids):
    """`(B, T)` bool, True for real tokens (id 0 is padding)."""
    return masks.padding_mask(token_ids, 0)


def position_layer(config, name):
    if config.position == "learned":
        return layers.PositionEmbedding(
            config.max_sequence_length, initializer=kernel_initializer(config), name=name
        )
    return layers.SinusoidalPositionEncoding(name=name)


def block_kwargs(config):
    return dict(
        num_heads=config.num_heads,
        intermediate_dim=config.intermediate_dim,
        dropout=config.dropout,
        activation=config.activation,
        norm_first=config.norm_first,
        layer_norm_epsilon=config.layer_norm_epsilon,
        score=config.score,
        kernel_initializer=kernel_initializer(config),
    )


def final_norm(config, name):
    """Pre-LN stacks end with a LayerNorm (GPT-2); post-LN ones are already normalised."""
    if not config.norm_first:
        return None
    return layers.LayerNorm(epsilon=config.layer_norm_epsilon, name=name)


def embed_tokens(embedding, position, token_ids, start_index=0):
    """Token embedding (scaled by sqrt(d) if configured) plus positions, `(B, T, D)`."""
    x = embedding(token_ids)  # (B, T, D)
    return x + position(x, start_index=start_index)


class TransformerModel(keras.Model):
    """A functional `keras.Model` built from a `TransformerConfig`.

    Subclasses implement `_build(config)` returning `(inputs, outputs,
    sublayers)`; `sublayers` (a dict) become attributes once the graph exists. `get_config()` is `{"config": ...}`
    so `.keras` files reload with `safe_mode=True`.
    """

    def __init__(self, config, **kwargs):
        config = as_config(config)
        inputs, outputs, sublayers = self._build(config)
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self.config = config
        # Named handles on the layers for incremental decoding and conversion.
        for name, layer in sublayers.items():
            setattr(self, name, layer)

    def _build(self, config):
        raise NotImplementedError

    def get_config(self):
        return {"config": self.config.to_dict(), "name": self.name, "trainable": self.trainable}

    @classmethod
    def from_config(cls, config):
        return cls(**config)
