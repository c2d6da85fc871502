"""fit(): `model.fit` where Keras supports the strategy, our distributed loop where it does not.

Keras 3.15's `model.fit` fails under `MultiWorkerMirroredStrategy` (keras#20585:
`_maybe_symbolic_build` reduces an integer batch, then `reduce_per_replica`
fails). Under that strategy `fit()` runs a custom loop on the same engine
(`strategy.experimental_distribute_dataset` + `strategy.run` + the compiled
Keras optimizer and loss), driving the same Keras callbacks, so logs,
checkpoints and backups look the same either way.
"""

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


def distributed_loop(model, train_data, validation_data, epochs, steps_per_epoch, callbacks, strategy):
    """model.fit's contract, by hand: per-replica loss scaled by the global batch, Keras optimizer, Keras callbacks."""
    loss_fn, optimizer = model.loss, model.optimizer
    replicas = strategy.num_replicas_in_sync

    def replica_step(inputs, labels):
        with tf.GradientTape() as tape:
            logits = model(inputs, training=True)
            values = loss_fn.call(labels, logits)  # per token (B_local, T), as Keras' sum_over_batch_size sees it
            loss = tf.reduce_sum(values) / tf.cast(tf.size(values) * replicas, values.dtype)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    @tf.function
    def train_step(batch):
        per_replica = strategy.run(replica_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    @tf.function
    def eval_step(batch):
        def replica(inputs, labels):
            values = loss_fn.call(labels, model(inputs, training=False))
            return tf.reduce_sum(values) / tf.cast(tf.size(values) * replicas, values.dtype)

        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica, args=batch), axis=None)

    with strategy.scope():
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
    dist_train = strategy.experimental_distribute_dataset(train_data)
    callback_list = keras.callbacks.CallbackList(callbacks, model=model, add_history=True, add_progbar=False,
                                                 epochs=epochs, steps=steps_per_epoch)
    model.stop_training = False
    initial_epoch = compat.begin_training(callback_list, model)  # where a BackupAndRestore resumed the run
    for epoch in range(initial_epoch, epochs):
        callback_list.on_epoch_begin(epoch)
        total, count = 0.0, 0
        for step, batch in enumerate(dist_train):
            if steps_per_epoch is not None and step >= steps_per_epoch:
                break
            callback_list.on_train_batch_begin(step)
            loss = float(train_step(batch))
            total, count = total + loss, count + 1
            callback_list.on_train_batch_end(step, {"loss": total / count})
            if model.stop_training:
                break
        logs = {"loss": total / max(count, 1)}
        if validation_data is not None:
            losses = [float(eval_step(b)) for b in strategy.experimental_distribute_dataset(validation_data)]
            logs["val_loss"] = sum(losses) / max(len(losses), 1)
        callback_list.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callback_list.on_train_end(logs)
    return model.history.history
