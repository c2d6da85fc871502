"""fit(): `model.fit` where Keras supports the strategy, our distributed loop where it does not.

Keras 3.15's `model.fit` fails under `MultiWorkerMirroredStrategy` (keras#20585:
`_maybe_symbolic_build` reduces an integer batch, then `reduce_per_replica`
fails). Under that strategy `fit()` runs a custom loop on the same engine
(`strategy.experimental_distribute_dataset` + `strategy.run` + the compiled
Keras optimizer and loss), driving the same Keras callbacks, so logs,
checkpoints and backups look the same either way.
"""

import functools
import os

import keras
import tensorflow as tf

from tfformer import compat
from tfformer.training.callbacks import AtomicBackupAndRestore, TimeBudget
from tfformer.training.strategy import evenly_split


def default_callbacks(run_dir=None, time_budget=None, early_stopping_patience=None, backup_every=None, chief=True):
    """Checkpoint, backup (resume after a kill), TensorBoard, CSV log, early stopping, time budget."""
    callbacks = []
    if time_budget is not None:
        callbacks.append(TimeBudget(time_budget))
    if early_stopping_patience:
        callbacks.append(keras.callbacks.EarlyStopping(monitor="val_loss", patience=early_stopping_patience,
                                                       restore_best_weights=True))
    if run_dir and chief:
        os.makedirs(run_dir, exist_ok=True)
        callbacks += [
            AtomicBackupAndRestore(os.path.join(run_dir, "backup"), save_freq=backup_every or "epoch",
                                   delete_checkpoint=True),
            keras.callbacks.ModelCheckpoint(os.path.join(run_dir, "checkpoint.weights.h5"), save_weights_only=True),
            keras.callbacks.TensorBoard(os.path.join(run_dir, "logs"), update_freq=100),
            keras.callbacks.CSVLogger(os.path.join(run_dir, "history.csv"), append=True),
        ]
    return callbacks


def _is_multi_worker(strategy):
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def fit(model, train_data, validation_data=None, epochs=1, steps_per_epoch=None, callbacks=(), strategy=None,
        verbose="auto", **callback_kwargs):
    """Train a compiled model; returns the history dict `{metric: [per-epoch values]}`.

    `callback_kwargs` go to `default_callbacks` (`run_dir`, `time_budget`,
    `early_stopping_patience`, `backup_every`). Under
    `MultiWorkerMirroredStrategy` the custom loop runs instead of `model.fit`.
    """
    if getattr(model, "optimizer", None) is None or getattr(model, "loss", None) is None:
        raise ValueError("`model` must be compiled (optimizer and loss) before fit(); compile it in strategy.scope().")
    strategy = strategy or tf.distribute.get_strategy()
    chief = not _is_multi_worker(strategy) or strategy.cluster_resolver.task_id == 0
    all_callbacks = list(callbacks) + default_callbacks(chief=chief, **callback_kwargs)
    if not _is_multi_worker(strategy):
        # Keras can't shuffle a tf.data.Dataset (the pipeline does) and warns on every fit if asked to, as by default.
        shuffle = not isinstance(train_data, tf.data.Dataset)
        validation_data = evenly_split(validation_data, strategy)
        history = model.fit(train_data, validation_data=validation_data, epochs=epochs, shuffle=shuffle,
                            steps_per_epoch=steps_per_epoch, callbacks=all_callbacks, verbose=verbose)
        return history.history
    return distributed_loop(model, train_data, validation_data, epochs, steps_per_epoch, all_callbacks, strategy)


def _loss_values(loss):
    """`(labels, outputs) -> unreduced loss values` of a compiled `loss`: a `keras.losses.Loss`, a name or a
    function (per sample, as Keras' functions reduce only their last axis)."""
    if isinstance(loss, keras.losses.Loss):
        return loss.call
    if isinstance(loss, (dict, list, tuple)):
        raise ValueError("fit() under MultiWorkerMirroredStrategy takes one loss for one output. Received: "
                         f"loss={loss!r}")
    return keras.losses.get(loss)


def _replica_loss(model, values_of, replicas, batch, training):
    """`(loss / replicas, rows)` of one replica's batch: the sample-weighted loss values over their count (Keras'
    sum_over_batch_size) plus `model.losses`; the loss is summed across the replicas."""
    inputs, labels, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    values = values_of(labels, model(inputs, training=training))  # per token (B_local, T), or per row
    if sample_weight is not None:
        weight = tf.cast(sample_weight, values.dtype)
        for _ in range(len(values.shape) - len(weight.shape)):
            weight = weight[..., None]  # (B,) -> (B, 1)
        values = values * weight
    loss = tf.reduce_sum(values) / tf.cast(tf.size(values), values.dtype)
    if model.losses:
        loss += tf.cast(tf.add_n(model.losses), loss.dtype)
    return loss / replicas, tf.shape(tf.nest.flatten(inputs)[0])[0]


def distributed_loop(model, train_data, validation_data, epochs, steps_per_epoch, callbacks, strategy):
    """model.fit's contract, by hand, on `strategy`: batches `(x, y)` or `(x, y, sample_weight)`; each replica's loss
    (the sample-weighted values over their count, plus `model.losses`) divided by the replica count; the
    optimizer's loss scale (LossScaleOptimizer under mixed_float16); Keras callbacks. Epoch losses weight each batch
    by its rows, as Keras' loss tracker does; with `steps_per_epoch` an epoch goes on from where the last stopped."""
    values_of, optimizer = _loss_values(model.loss), model.optimizer
    replica_loss = functools.partial(_replica_loss, model, values_of, strategy.num_replicas_in_sync)

    def replica_step(batch):
        with tf.GradientTape() as tape:
            loss, rows = replica_loss(batch, training=True)
            scaled = optimizer.scale_loss(loss)  # the loss itself unless a LossScaleOptimizer
        optimizer.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)
        return loss, rows

    def reduced(per_replica):
        return tuple(strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None) for value in per_replica)

    train_step = tf.function(lambda batch: reduced(strategy.run(replica_step, args=(batch,))))
    eval_step = tf.function(lambda batch: reduced(strategy.run(replica_loss, args=(batch, False))))

    with strategy.scope():
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
    dist_train = strategy.experimental_distribute_dataset(train_data)
    callback_list = keras.callbacks.CallbackList(callbacks, model=model, add_history=True, add_progbar=False,
                                                 epochs=epochs, steps=steps_per_epoch)
    model.stop_training = False
    initial_epoch = compat.begin_training(callback_list, model)  # where a BackupAndRestore resumed the run
    iterator, logs = None, {}
    for epoch in range(initial_epoch, epochs):
        callback_list.on_epoch_begin(epoch)
        if iterator is None or steps_per_epoch is None:
            iterator = iter(dist_train)
        total, rows, step = 0.0, 0, 0
        while steps_per_epoch is None or step < steps_per_epoch:
            batch = next(iterator, None)
            if batch is None and step == 0 and steps_per_epoch is not None:  # the last epoch ended with the data
                iterator = iter(dist_train)
                batch = next(iterator, None)
            if batch is None:
                iterator = None  # the data ran out: Keras ends the epoch there and reads them again at the next
                break
            callback_list.on_train_batch_begin(step)
            loss, batch_rows = train_step(batch)
            total, rows = total + float(loss) * int(batch_rows), rows + int(batch_rows)
            callback_list.on_train_batch_end(step, {"loss": total / rows})
            step += 1
            if model.stop_training:
                break
        logs = {"loss": total / max(rows, 1)}
        if validation_data is not None:
            answers = [eval_step(b) for b in strategy.experimental_distribute_dataset(validation_data)]
            val_rows = sum(int(n) for _, n in answers)
            logs["val_loss"] = sum(float(loss) * int(n) for loss, n in answers) / max(val_rows, 1)
        callback_list.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callback_list.on_train_end(logs)
    return model.history.history
