"""Everything model.fit needs: schedules, losses, metrics, strategies."""

from tfformer.training.callbacks import (AtomicBackupAndRestore, EvaluateEvery, StopAfterSteps, TimeBudget,
                                         parse_duration)
from tfformer.training.fit import default_callbacks, distributed_loop, fit
from tfformer.training.losses import MaskedSparseCrossEntropy
from tfformer.training.metrics import (MaskedAccuracy, Perplexity, TokenStatistics, corpus_bleu, normalize_transcript,
                                       word_error_rate)
from tfformer.training.optimizers import FusedAdam, FusedAdamW
from tfformer.training.schedules import TransformerSchedule, WarmupCosine, transformer_optimizer
from tfformer.training.strategy import configure_cpu_threads, evenly_split, get_strategy, mixed_precision_policy

__all__ = [
    "AtomicBackupAndRestore",
    "EvaluateEvery",
    "StopAfterSteps",
    "TimeBudget",
    "TokenStatistics",
    "default_callbacks",
    "distributed_loop",
    "fit",
    "FusedAdam",
    "FusedAdamW",
    "parse_duration",
    "MaskedAccuracy",
    "MaskedSparseCrossEntropy",
    "Perplexity",
    "TransformerSchedule",
    "WarmupCosine",
    "configure_cpu_threads",
    "evenly_split",
    "corpus_bleu",
    "normalize_transcript",
    "word_error_rate",
    "get_strategy",
    "mixed_precision_policy",
    "transformer_optimizer",
]
