"""Callbacks for model.fit and for our distributed loop alike."""

import re
import time

import keras

from tfformer.checks import check_int, is_number
from tfformer.files import atomic_path, write_atomic
from tfformer.training.strategy import evenly_split

_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_duration(text):
    """'90s', '15m', '1.5h' or a plain number of seconds -> seconds (float)."""
    if is_number(text):
        seconds = float(text)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
        if not match:
            raise ValueError(f"Cannot parse the time budget {text!r}: expected e.g. '90s', '15m' or '1.5h'.")
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if seconds <= 0:
        raise ValueError(f"The time budget must be positive. Received: {text!r}")
    return seconds


class TimeBudget(keras.callbacks.Callback):
    """Stops training once `seconds` of wall-clock time have passed (checked after every batch)."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = parse_duration(seconds)
        self.start = None
        self.exhausted = False

    def on_train_begin(self, logs=None):
        self.start = time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        if time.monotonic() - self.start >= self.seconds:
            self.exhausted = True
            self.model.stop_training = True

    def remaining(self):
        return self.seconds - (time.monotonic() - self.start) if self.start is not None else self.seconds


class StopAfterSteps(keras.callbacks.Callback):
    """Ends `fit` after `steps` training steps of this `fit` call (quick runs, smoke benchmarks and tests; a time
    budget still applies)."""

    def __init__(self, steps):
        super().__init__()
        self.steps, self.seen = steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen >= self.steps:
            self.model.stop_training = True


class EvaluateEvery(keras.callbacks.Callback):
    """Prints validation loss/metrics every `every` training steps, so long epochs still show a curve.

    The rows are also kept in `self.rows` (step, seconds, train and validation logs).
    """

    def __init__(self, validation_data, every=200, steps=None, printer=print):
        super().__init__()
        check_int("every", every)
        self.validation_data = validation_data
        self.every = every
        self.steps = steps
        self.printer = printer
        self.rows = []
        self._step = 0
        self._start = None

    def on_train_begin(self, logs=None):
        self._start = time.monotonic()
        self.validation_data = evenly_split(self.validation_data, self.model.distribute_strategy)

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        if self._step % self.every == 0:
            self._evaluate(logs)

    def on_train_end(self, logs=None):
        if self._step % self.every:
            self._evaluate(logs)

    def _evaluate(self, logs):
        val = self.model.evaluate(self.validation_data, steps=self.steps, verbose=0, return_dict=True)
        row = {"step": self._step, "seconds": round(time.monotonic() - self._start, 1)}
        row.update({k: float(v) for k, v in (logs or {}).items()})
        row.update({f"val_{k}": float(v) for k, v in val.items()})
        self.rows.append(row)
        self.printer(
            f"step {row['step']:6d}  {row['seconds']:7.1f}s  loss {row.get('loss', float('nan')):.4f}  "
            + "  ".join(f"{k} {v:.4f}" for k, v in row.items() if k.startswith("val_"))
        )


class AtomicBackupAndRestore(keras.callbacks.BackupAndRestore):
    """`BackupAndRestore` whose files are replaced atomically, so a kill mid-save never corrupts the backup.

    Weights and metadata are written to temporary files beside the backup and
    renamed over it; the metadata is renamed last, after the weights it describes.
    Restoring is Keras' own (`on_train_begin`): the files carry the names it reads
    (`WEIGHTS_FILE`, `METADATA_FILE`), and tests/training/test_training.py resumes
    a run from them.
    """

    WEIGHTS_FILE = "latest.weights.h5"
    METADATA_FILE = "training_metadata.json"

    def __init__(self, backup_dir, **kwargs):
        super().__init__(backup_dir, **kwargs)
        self._epoch = 0  # the epoch a restored run starts at: the current one until it ends
        self._batch = 0  # the last batch seen in this epoch
        self._unsaved_batches = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        self._epoch, self._batch = epoch + 1, 0
        if self.save_freq == "epoch":
            self._write_backup()

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq == "epoch":
            return
        # `batch` restarts at 0 each epoch, and may advance by several (`steps_per_execution`).
        self._unsaved_batches += batch + 1 if batch <= self._batch else batch - self._batch
        self._batch = batch
        if self._unsaved_batches >= self.save_freq:
            self._unsaved_batches = 0
            self._write_backup()

    def _write_backup(self):
        import json
        import os

        os.makedirs(self.backup_dir, exist_ok=True)
        weights = os.path.join(self.backup_dir, self.WEIGHTS_FILE)
        metadata = os.path.join(self.backup_dir, self.METADATA_FILE)
        with atomic_path(weights) as tmp:
            self.model.save_weights(filepath=tmp, overwrite=True)
        write_atomic(metadata, json.dumps({"epoch": self._epoch, "batch": self._batch}))
