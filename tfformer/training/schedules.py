"""Learning-rate schedules as serializable `keras.optimizers.schedules.LearningRateSchedule`s."""

import keras
from keras import ops

from tfformer.checks import check_int
from tfformer.training.optimizers import FusedAdamW


@keras.saving.register_keras_serializable(package="tfformer")
class TransformerSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The paper's schedule: `lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)` (step counted from 1).

    Args:
        hidden_dim: int. `d_model`.
        warmup_steps: int. Defaults to `4000`.
        scale: float. Multiplies the whole schedule. Defaults to `1.0`.
    """

    def __init__(self, hidden_dim, warmup_steps=4000, scale=1.0):
        check_int("hidden_dim", hidden_dim)
        check_int("warmup_steps", warmup_steps)
        self.hidden_dim = hidden_dim
        self.warmup_steps = warmup_steps
        self.scale = scale

    def __call__(self, step):
        step = ops.cast(step, "float32") + 1.0
        return self.scale * self.hidden_dim**-0.5 * ops.minimum(step**-0.5, step * self.warmup_steps**-1.5)

    def get_config(self):
        return {"hidden_dim": self.hidden_dim, "warmup_steps": self.warmup_steps, "scale": self.scale}


@keras.saving.register_keras_serializable(package="tfformer")
class WarmupCosine(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up to `peak_learning_rate` over `warmup_steps`, then cosine decay to `end_learning_rate`."""

    def __init__(self, peak_learning_rate, warmup_steps, decay_steps, end_learning_rate=0.0):
        check_int("warmup_steps", warmup_steps, minimum=0)
        check_int("decay_steps", decay_steps, minimum=0)
        self.peak_learning_rate = peak_learning_rate
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.end_learning_rate = end_learning_rate

    def __call__(self, step):
        step = ops.cast(step, "float32")
        warm = self.peak_learning_rate * (step + 1.0) / max(self.warmup_steps, 1)
        progress = ops.clip((step - self.warmup_steps) / max(self.decay_steps, 1), 0.0, 1.0)
        cosine = self.end_learning_rate + 0.5 * (self.peak_learning_rate - self.end_learning_rate) * (
            1.0 + ops.cos(3.141592653589793 * progress)
        )
        return ops.where(step < self.warmup_steps, warm, cosine)

    def get_config(self):
        return {
            "peak_learning_rate": self.peak_learning_rate,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "end_learning_rate": self.end_learning_rate,
        }


def transformer_optimizer(hidden_dim, warmup_steps=4000, weight_decay=0.0, clipnorm=None, learning_rate=None):
    """AdamW (`FusedAdamW`) with the paper's beta_1=0.9, beta_2=0.98, epsilon=1e-9 and (by default) its warm-up
    schedule."""
    return FusedAdamW(
        learning_rate=learning_rate or TransformerSchedule(hidden_dim, warmup_steps),
        beta_1=0.9,
        beta_2=0.98,
        epsilon=1e-9,
        weight_decay=weight_decay,
        clipnorm=clipnorm,
    )
