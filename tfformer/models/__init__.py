"""Functional-API Transformer models and the preset zoo."""

from tfformer.models.causal_lm import CausalLM, build_causal_lm
from tfformer.models.config import TransformerConfig
from tfformer.models.encoder import TransformerEncoder, build_encoder
from tfformer.models.presets import build_model, from_preset, get_preset, list_presets
from tfformer.models.regressor import SequenceRegressor, build_regressor
from tfformer.models.sentence_encoder import SentenceEncoder, cosine_similarity
from tfformer.models.seq2seq import Seq2SeqTransformer, build_seq2seq
from tfformer.models.transcript import Segment, TranscriptOptions
from tfformer.models.whisper import WhisperModel, build_whisper

__all__ = [
    "CausalLM",
    "Segment",
    "SentenceEncoder",
    "SequenceRegressor",
    "Seq2SeqTransformer",
    "TransformerConfig",
    "TransformerEncoder",
    "TranscriptOptions",
    "WhisperModel",
    "build_causal_lm",
    "build_encoder",
    "build_model",
    "build_regressor",
    "build_seq2seq",
    "build_whisper",
    "cosine_similarity",
    "from_preset",
    "get_preset",
    "list_presets",
]
