"""Adam and AdamW whose per-variable update is one fused TensorFlow kernel (`ResourceApplyAdam`)."""

import keras
import tensorflow as tf

from tfformer import compat


class _FusedAdamUpdate:
    """`update_step` of Keras' Adam as one `ResourceApplyAdam` per variable (see `FusedAdam`), on moment slots
    of its own made as Keras' Adam makes them (same names, same order), so that saved optimizers load alike."""

    def build(self, var_list):
        if self.built:
            return
        if not self.weight_decay:  # 0 or None: Keras would still run three ops per variable for a decay of 0
            self.exclude_from_weight_decay(var_list=var_list)
        if self.amsgrad:  # Keras' own update, which reads Keras' own slots
            return super().build(var_list)
        super(keras.optimizers.Adam, self).build(var_list)  # the optimizer's own state; the slots follow
        self._adam_slots = []  # (momentum, velocity) per variable, or None where Keras makes no slots
        for variable in var_list:
            if variable.overwrite_with_gradient:
                self._adam_slots.append(None)
            else:
                self._adam_slots.append((self.add_variable_from_reference(variable, name="momentum"),
                                         self.add_variable_from_reference(variable, name="velocity")))

    def update_step(self, gradient, variable, learning_rate):
        # An embedding lookup's gradient is IndexedSlices with a row per lookup: summed into a dense gradient.
        gradient = tf.convert_to_tensor(gradient)
        if self.amsgrad:
            return super().update_step(gradient, variable, learning_rate)
        dtype = variable.dtype
        m, v = self._adam_slots[compat.optimizer_variable_index(self, variable)]
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
    pass over the variable; one `ResourceApplyAdam` kernel per variable makes
    one pass, in a fraction of the time on a CPU (docs/performance.md). The math is
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
    update); with `weight_decay=0` every variable is excluded from it
    (`exclude_from_weight_decay`) instead of being multiplied by zero.
    """
