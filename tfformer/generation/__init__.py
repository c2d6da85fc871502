"""Decoding, kept apart from the models (keras-hub's sampler pattern): one loop in `Sampler.run`, driven by a
task's `next` callback; beam search in `BeamSampler`; the CPU fast paths in `DecodePlan`."""

from tfformer.generation.beam import BeamSampler
from tfformer.generation.decode import decode_fn, generate_ids, reset_compiled, strip_after_end
from tfformer.generation.plan import DecodePlan
from tfformer.generation.samplers import GreedySampler, Sampler, TemperatureSampler, TopKSampler, TopPSampler

__all__ = ["BeamSampler", "DecodePlan", "GreedySampler", "Sampler", "TemperatureSampler", "TopKSampler", "TopPSampler",
           "decode_fn", "generate_ids", "reset_compiled", "strip_after_end"]
