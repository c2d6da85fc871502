import keras

from tfformer import layers
from tfformer.models import base


@keras.saving.register_keras_serializable(package="tfformer")
class Seq2SeqTransformer(base.TransformerModel):
    """The encoder-decoder Transformer of "Attention Is All You Need".

    Inputs: `{"encoder_token_ids": (B, S) int32, "decoder_token_ids": (B, T) int32}`,
    id 0 = padding (masks are derived from it). Output: logits `(B, T, V)` float32.
    Position `t` of the logits depends only on decoder tokens `<= t`.

    With `tie_embeddings` one matrix embeds source and target tokens and is the
    pre-softmax projection (the paper's three-way sharing).
    """

    def _build(self, config):
        init = base.kernel_initializer(config)
        token_embedding = layers.TokenEmbedding(
            config.vocabulary_size, config.hidden_dim, scale=config.scale_embeddings, name="token_embedding"
        )
        if config.tie_embeddings:
            decoder_embedding, output_projection = token_embedding, None
        else:
            decoder_embedding = layers.TokenEmbedding(
                config.vocabulary_size, config.hidden_dim, scale=config.scale_embeddings, name="decoder_token_embedding"
            )
            output_projection = keras.layers.Dense(
                config.vocabulary_size, kernel_initializer=init, dtype="float32", name="output_projection"
            )
        encoder_position = base.position_layer(config, "encoder_position")
        decoder_position = base.position_layer(config, "decoder_position")
        encoder_dropout = keras.layers.Dropout(config.dropout, name="encoder_embedding_dropout")
        decoder_dropout = keras.layers.Dropout(config.dropout, name="decoder_embedding_dropout")
        encoder_blocks = [
            layers.EncoderBlock(**base.block_kwargs(config), name=f"encoder_block_{i}")
            for i in range(config.num_encoder_layers)
        ]
        decoder_blocks = [
            layers.DecoderBlock(**base.block_kwargs(config), name=f"decoder_block_{i}")
            for i in range(config.num_decoder_layers)
        ]
        encoder_norm = base.final_norm(config, "encoder_norm")
        decoder_norm = base.final_norm(config, "decoder_norm")

        # === Functional model ===
        encoder_ids = base.token_ids_input("encoder_token_ids")
        decoder_ids = base.token_ids_input("decoder_token_ids")
        encoder_mask = base.padding_mask_of(encoder_ids)  # (B, S)
        decoder_mask = base.padding_mask_of(decoder_ids)  # (B, T)

        x = encoder_dropout(base.embed_tokens(token_embedding, encoder_position, encoder_ids))  # (B, S, D)
        for block in encoder_blocks:
            x = block(x, padding_mask=encoder_mask)
        encoder_outputs = encoder_norm(x) if encoder_norm else x

        y = decoder_dropout(base.embed_tokens(decoder_embedding, decoder_position, decoder_ids))  # (B, T, D)
        for block in decoder_blocks:
            y = block(y, encoder_outputs, padding_mask=decoder_mask, encoder_padding_mask=encoder_mask)
        if decoder_norm:
            y = decoder_norm(y)
        logits = token_embedding(y, reverse=True) if output_projection is None else output_projection(y)  # (B, T, V)

        inputs = {"encoder_token_ids": encoder_ids, "decoder_token_ids": decoder_ids}
        sublayers = dict(
            token_embedding=token_embedding,
            decoder_token_embedding=decoder_embedding,
            output_projection=output_projection,
            encoder_position=encoder_position,
            decoder_position=decoder_position,
            encoder_blocks=encoder_blocks,
            decoder_blocks=decoder_blocks,
            encoder_norm=encoder_norm,
            decoder_norm=decoder_norm,
        )
        return inputs, logits, sublayers


def build_seq2seq(config):
    """Build the paper's encoder-decoder Transformer from a `TransformerConfig` (or dict)."""
    config = base.as_config(config)
    if config.architecture != "seq2seq":
        config = config.replace(architecture="seq2seq")
    return Seq2SeqTransformer(config)
