"""tfformer's Keras layers: one public layer per module."""

from tfformer.layers import layer_utils, masks
from tfformer.layers.attention import MultiHeadAttention
from tfformer.layers.decoder_block import DecoderBlock
from tfformer.layers.dropout import Dropout
from tfformer.layers.encoder_block import EncoderBlock
from tfformer.layers.feedforward import FeedForward
from tfformer.layers.gated_feedforward import GatedFeedForward
from tfformer.layers.layer_norm import LayerNorm
from tfformer.layers.position_embedding import PositionEmbedding
from tfformer.layers.rms_norm import RMSNorm
from tfformer.layers.rotary_embedding import RotaryEmbedding
from tfformer.layers.sinusoidal_position_encoding import SinusoidalPositionEncoding
from tfformer.layers.token_embedding import TokenEmbedding

__all__ = [
    "layer_utils",
    "masks",
    "MultiHeadAttention",
    "DecoderBlock",
    "Dropout",
    "EncoderBlock",
    "FeedForward",
    "GatedFeedForward",
    "LayerNorm",
    "PositionEmbedding",
    "RMSNorm",
    "RotaryEmbedding",
    "SinusoidalPositionEncoding",
    "TokenEmbedding",
]
