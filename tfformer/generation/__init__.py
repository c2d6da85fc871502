"""Decoding, kept apart from the models (keras-hub's sampler pattern)."""

from tfformer.generation.decode import decode_fn, generate_ids, strip_after_end
from tfformer.generation.plan import DecodePlan
from tfformer.generation.samplers import Sampler
from tfformer.generation.speech import speech_decode_fn, transcribe_ids
from tfformer.generation.text import generate, translate

__all__ = [
    "DecodePlan", "Sampler", "decode_fn", "generate", "generate_ids", "speech_decode_fn", "strip_after_end",
    "transcribe_ids", "translate",
]
