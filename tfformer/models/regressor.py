import keras
from keras import ops

from tfformer import layers
from tfformer.models import base


@keras.saving.register_keras_serializable(package="tfformer")
class SequenceRegressor(base.TransformerModel):
    """A Transformer encoder over sequences of vectors (time series), with a regression head.

    The input embedding is the linear map `x_e = W_e x` of each `input_dim`
    vector, plus position encodings. Input: `{"inputs": (B, T, input_dim)
    float32}`. Output: `{"predictions": (B, output_dim) float32}` from the mean
    of the final hidden states.
    """

    def _build(self, config, dtype):
        init = base.kernel_initializer  # a new initializer for each layer: an instance repeats its values
        input_projection = keras.layers.Dense(config.hidden_dim, kernel_initializer=init(config), dtype=dtype,
                                              name="input_projection")
        position = base.position_layer(config, "position", dtype)
        dropout = layers.Dropout(config.dropout, dtype=dtype, name="embedding_dropout")
        blocks = base.encoder_blocks(config, dtype)
        norm = base.final_norm(config, "final_norm", dtype)
        head = keras.layers.Dense(config.output_dim, kernel_initializer=init(config), dtype="float32",
                                 name="regression_head")

        # === Functional model ===
        features = keras.Input(shape=(None, config.input_dim), dtype="float32", name="inputs")
        x = input_projection(features)  # (B, T, D)
        x = dropout(x + position(x))
        for block in blocks:
            x = block(x)
        if norm:
            x = norm(x)
        predictions = head(ops.mean(x, axis=1))  # (B, output_dim)

        sublayers = dict(input_projection=input_projection, position=position, encoder_blocks=blocks, final_norm=norm,
                         head=head, hidden_states=x)  # hidden states: (B, T, D)
        return {"inputs": features}, {"predictions": predictions}, sublayers


def build_regressor(config, dtype=None):
    """Build an encoder over continuous `input_dim` vectors with a regression head. `dtype`: the
    dtype policy of every layer (`TransformerModel`'s `dtype`; None: the global one)."""
    config = base.as_config(config)
    if config.architecture != "regressor":
        config = config.replace(architecture="regressor")
    return SequenceRegressor(config, dtype=dtype)
