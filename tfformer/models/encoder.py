import keras

from tfformer import layers
from tfformer.models import base


@keras.saving.register_keras_serializable(package="tfformer")
class TransformerEncoder(base.TransformerModel):
    """A BERT-style encoder.

    Inputs: `{"token_ids": (B, T) int32}` plus `"segment_ids"` `(B, T)` when
    `num_segments > 0`; id 0 = padding. Embeddings are token + learned (or
    sinusoidal) position + segment, then LayerNorm and dropout, as in BERT.
    Outputs: `{"sequence_output": (B, T, D), "pooled_output": (B, D)}` (tanh
    dense over the first token) and `"logits"` `(B, num_classes)` float32 when
    `num_classes` is set. Outputs at real positions never depend on padding.
    """

    def _build(self, config, dtype):
        init = base.kernel_initializer  # a new initializer for each layer: an instance repeats its values
        token_embedding = layers.TokenEmbedding(
            config.vocabulary_size,
            config.hidden_dim,
            scale=config.scale_embeddings,
            initializer=init(config) if config.initializer_range else None,
            dtype=dtype, name="token_embedding",
        )
        position = base.position_layer(config, "position", dtype)
        segment_embedding = None
        if config.num_segments:
            segment_embedding = keras.layers.Embedding(
                config.num_segments, config.hidden_dim, embeddings_initializer=init(config), dtype=dtype,
                name="segment_embedding",
            )
        embedding_norm = layers.LayerNorm(epsilon=config.layer_norm_epsilon, dtype=dtype, name="embedding_norm")
        dropout = layers.Dropout(config.dropout, dtype=dtype, name="embedding_dropout")
        blocks = base.encoder_blocks(config, dtype)
        norm = base.final_norm(config, "final_norm", dtype)
        pooler = keras.layers.Dense(config.hidden_dim, activation="tanh", kernel_initializer=init(config),
                                    dtype=dtype, name="pooler")
        classifier = None
        if config.num_classes:
            classifier = keras.layers.Dense(config.num_classes, kernel_initializer=init(config), dtype="float32",
                                            name="classifier")

        # === Functional model ===
        token_ids = base.token_ids_input("token_ids")
        inputs = {"token_ids": token_ids}
        padding_mask = base.padding_mask_of(token_ids)  # (B, T)
        x = base.embed_tokens(token_embedding, position, token_ids)  # (B, T, D)
        if segment_embedding is not None:
            inputs["segment_ids"] = base.token_ids_input("segment_ids")
            x = x + segment_embedding(inputs["segment_ids"])
        x = dropout(embedding_norm(x))
        for block in blocks:
            x = block(x, padding_mask=padding_mask)
        if norm:
            x = norm(x)
        outputs = {"sequence_output": x, "pooled_output": pooler(x[:, 0, :])}  # pooled: (B, D)
        if classifier is not None:
            outputs["logits"] = classifier(outputs["pooled_output"])  # (B, num_classes)

        sublayers = dict(
            token_embedding=token_embedding,
            position=position,
            segment_embedding=segment_embedding,
            embedding_norm=embedding_norm,
            encoder_blocks=blocks,
            final_norm=norm,
            pooler=pooler,
            classifier=classifier,
            hidden_states=x,  # (B, T, D)
        )
        return inputs, outputs, sublayers


def build_encoder(config, dtype=None):
    """Build a BERT-style encoder from a `TransformerConfig` (or dict). `dtype`: the
    dtype policy of every layer (`TransformerModel`'s `dtype`; None: the global one)."""
    config = base.as_config(config)
    if config.architecture != "encoder":
        config = config.replace(architecture="encoder")
    return TransformerEncoder(config, dtype=dtype)
