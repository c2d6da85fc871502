"""Adam and AdamW whose per-variable update is one fused TensorFlow kernel (`ResourceApplyAdam`)."""

import keras
import tensorflow as tf


class _FusedAdamUpdate:
    """`update_step` of Keras' Adam as one `ResourceApplyAdam` per variable (see `FusedAdam`)."""

    def update_step(self, gradient, variable, learning_rate):
        # An embedding lookup's gradient is IndexedSlices with a row per lookup: summed into a dense gradient.
        gradient = tf.convert_to_tensor(gradient)
        if self.amsgrad:
            return super().update_step(gradient, variable, learning_rate)
        dtype = variable.dtype
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        step = tf.cast(self.iterations + 1, dtype)
        beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
        gradient = tf.cast(gradient, dtype)
        tf.raw_ops.ResourceApplyAdam(
            var=variable.handle,
            m=m.value.handle,
            v=v.value.handle,
            beta1_power=tf.pow(beta_1, step),
            beta2_power=tf.pow(beta_2, step),
            lr=tf.cast(learning_rate, dtype),
            beta1=beta_1,
            beta2=beta_2,
            epsilon=tf.cast(self.epsilon, dtype),
            grad=gradient,
        )


@keras.saving.register_keras_serializable(package="tfformer")
class FusedAdam(_FusedAdamUpdate, keras.optimizers.Adam):
    """`keras.optimizers.Adam` with one fused kernel per variable update.

    Keras' Adam updates a variable with about ten separate ops (two moment
    updates, a square, a square root, a division and their assignments), each a
    pass over the variable: 15-16 ms per step for the ~5M parameters of the
    GPT-shaped benchmark model on a 2-core CPU, against 6-7 ms as one
    `ResourceApplyAdam` kernel per variable (benchmarks/RESULTS.md). The math is
    the same, `m += (g - m)(1 - beta_1)`, `v += (g^2 - v)(1 - beta_2)`,
    `variable -= lr sqrt(1 - beta_2^t) / (1 - beta_1^t) * m / (sqrt(v) + epsilon)`,
    with the same arguments, config and slot variables (names and order), and the
    same results to float32 rounding, with one exception: a gradient of
    IndexedSlices (an untied embedding lookup) is summed into a dense gradient
    first, so a row looked up several times in a batch is updated with the sum
    of its gradients. Keras' own update squares each repeat before adding them
    into `v`. `amsgrad=True` takes Keras' update, on the summed gradient.

    Example:
    ```python
    model.compile(optimizer=tfformer.training.FusedAdam(1e-4), loss=...)
    ```
    """


@keras.saving.register_keras_serializable(package="tfformer")
class FusedAdamW(_FusedAdamUpdate, keras.optimizers.AdamW):
    """`keras.optimizers.AdamW` with one fused kernel per variable update.

    Its Adam update is `FusedAdam`'s, with the same arguments, config and slot
    variables as `keras.optimizers.AdamW`. The decoupled weight decay stays
    Keras' own (`variable -= variable * weight_decay * lr`, before the Adam
    update); with `weight_decay=0` it is skipped instead of multiplying every
    variable by zero.
    """

    def _apply_weight_decay(self, variables):
        if not self.weight_decay:  # 0.0: Keras would still run three ops per variable
            return
        return super()._apply_weight_decay(variables)
