"""What makes a tfformer model a task (keras-hub's split): a backbone, a head, a preprocessor, strings in and out,
and a preset directory on disk.

A task is the functional `keras.Model` `model.fit` trains (`CausalLM`, `Seq2SeqTransformer`, `TransformerEncoder`,
`SentenceEncoder`, `SequenceRegressor`, `WhisperModel`). Its `backbone` is a second functional model on the same
layers, inputs to hidden states, so the weights and the saved files are the task's own. Its `preprocessor` is the
tokenizer; it is not part of the Keras graph and is saved beside the model by `save_to_preset`.

A preset directory holds `preset.json` (the task class and the tokenizer's spec, written last), `config.json` (the
`TransformerConfig`), `model.keras` (loaded with `safe_mode=True`) and the tokenizer's file.
`tfformer.models.from_preset(directory)` reads it back; a `tfformer train` run directory is one.
"""

import json
import os

import keras
import numpy as np
import tensorflow as tf

from tfformer.data import assets
from tfformer.files import write_json
from tfformer.tokens import END_ID, PAD_ID
from tfformer.version import __version__

PRESET_FILE, CONFIG_FILE, MODEL_FILE = "preset.json", "config.json", "model.keras"


def check_preset_target(directory, overwrite=False):
    """Raise a ValueError unless `save_to_preset(directory, overwrite)` may write there: a directory (or nothing
    yet) that holds no preset, unless `overwrite`."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"`directory` {directory!r} exists and is not a directory.")
    if os.path.exists(os.path.join(directory, PRESET_FILE)) and not overwrite:
        raise ValueError(f"`directory` {directory!r} already holds a preset; pass `overwrite=True` to replace it.")
PRESET_FORMAT = "tfformer-preset"


def as_texts(texts, name, allow_blank=False):
    """`(list of str, single)`: `texts` as a non-empty list of str, non-blank unless `allow_blank`; `single` when
    one str was passed."""
    single = isinstance(texts, str)
    texts = [texts] if single else list(texts)
    if not texts:
        raise ValueError(f"`{name}` is empty; pass a string or a non-empty list of strings.")
    for text in texts:
        if not isinstance(text, str):
            raise ValueError(f"`{name}` must hold str. Received an element of type {type(text).__name__}: {text!r:.80}")
        if not allow_blank and not text.strip():
            raise ValueError(f"`{name}` holds an empty or whitespace-only string. Received: {text!r}")
    return texts, single


def is_token_ids(inputs):
    """True for token ids (a numeric tensor, array or nested list: `generation.generate_ids` names a float one),
    False for a str or a list of str."""
    if tf.is_tensor(inputs):
        return inputs.dtype.is_integer or inputs.dtype.is_floating
    if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], str)):
        return False
    array = np.asarray(inputs)
    return array.dtype.kind in "iu" or (array.dtype.kind == "f" and array.size > 0)  # [] is no texts, not ids


class Task:
    """Mixed into every tfformer model: its preprocessor, the texts it takes and its preset directory.

    Attributes:
        preprocessor: the tokenizer (`tfformer.data.SubwordTokenizer`, `BytePairTokenizer` or `BertTokenizer`),
            or None. Set it with `model.preprocessor = tokenizer`; `from_preset` sets it.
    """

    preprocessor = None

    @property
    def backbone(self):
        """The model from the task's inputs to its hidden states: a functional `keras.Model` on the task's layers
        (its weights are the task's)."""
        raise NotImplementedError(f"{type(self).__name__} has no backbone")

    @property
    def end_ids(self):
        """The ids that end a generated text: the preprocessor's `end_ids`, else the tokenizers' end id."""
        ids = getattr(self.preprocessor, "end_ids", None)
        return [int(i) for i in ids] if ids else [END_ID]

    def require_preprocessor(self, method):
        if self.preprocessor is None:
            raise ValueError(
                f"`{method}` takes strings, and this {type(self).__name__} has no preprocessor (tokenizer). Set "
                f"`model.preprocessor = tokenizer`, load the model with `tfformer.models.from_preset(directory)`, or "
                f"pass token ids."
            )
        return self.preprocessor

    def tokenize(self, texts):
        """Right-padded token ids `(B, L)` int32 (numpy) of a list of str, id 0 the padding."""
        tokenizer = self.require_preprocessor("tokenize")
        return tokenizer.tokenize(list(texts)).to_tensor(default_value=0).numpy().astype(np.int32)

    def detokenize(self, ids):
        """str per row of generated ids `(B, N)`, cut before the first end id (`end_ids`) or padding (id 0: the model
        reads it as padding, and the exported files stop at it)."""
        tokenizer = self.require_preprocessor("detokenize")
        rows = []
        for row in np.asarray(ids).tolist():
            cut = min((row.index(i) for i in (*self.end_ids, PAD_ID) if i in row), default=len(row))
            rows.append(row[:cut])
        ragged = tf.ragged.constant(rows, dtype=tf.int32, ragged_rank=1)  # (B, None)
        return [text.decode("utf-8") for text in tokenizer.detokenize(ragged).numpy()]

    def save_to_preset(self, directory, overwrite=False):
        """Write the task (config, weights, tokenizer) into `directory`, which `from_preset(directory)` reads.

        Other files in `directory` are left alone (a run directory keeps its metrics). A directory that already
        holds a preset is an error unless `overwrite`.
        """
        check_preset_target(directory, overwrite)
        os.makedirs(directory, exist_ok=True)
        spec = None
        if self.preprocessor is not None and not self.saves_preprocessor_in_config:
            spec = assets.save_tokenizer(self.preprocessor, directory)
        self.save(os.path.join(directory, MODEL_FILE))
        write_json(os.path.join(directory, CONFIG_FILE), self.transformer_config.to_dict())
        write_json(os.path.join(directory, PRESET_FILE), {
            "format": PRESET_FORMAT, "version": 1, "task": type(self).__name__, "model_file": MODEL_FILE,
            "tokenizer": spec, "tfformer_version": __version__,
        })
        return directory

    # Overridden by tasks whose Keras config already holds the tokenizer (SentenceEncoder).
    saves_preprocessor_in_config = False

    @property
    def transformer_config(self):
        """The `TransformerConfig` the task was built from."""
        return self.config


def load_preset(directory):
    """The task `Task.save_to_preset` wrote into `directory` (or a run directory of `tfformer train`)."""
    path = os.path.join(directory, PRESET_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            preset = json.load(handle)
        if not isinstance(preset, dict) or preset.get("format") != PRESET_FORMAT:
            raise ValueError(f"{path} is not a tfformer preset (expected \"format\": {PRESET_FORMAT!r}).")
    elif (os.path.isfile(os.path.join(directory, MODEL_FILE))
            and os.path.isfile(os.path.join(directory, "tokenizer.model"))):
        # A run directory written before presets existed: a model and a SentencePiece tokenizer.
        preset = {"task": None, "model_file": MODEL_FILE, "tokenizer": {"class": "SubwordTokenizer"}}
    else:
        raise ValueError(f"{directory!r} holds no preset (no {PRESET_FILE}); write one with `task.save_to_preset`.")
    model_path = os.path.join(directory, preset.get("model_file", MODEL_FILE))
    if not os.path.isfile(model_path):
        raise ValueError(f"{directory!r}: the preset's model file {os.path.basename(model_path)!r} is missing.")
    model = keras.models.load_model(model_path, safe_mode=True, compile=False)
    if preset.get("task") and type(model).__name__ != preset["task"]:
        raise ValueError(f"{directory!r}: preset.json names a {preset['task']} but {MODEL_FILE} holds a "
                         f"{type(model).__name__}.")
    if preset.get("tokenizer"):
        model.preprocessor = assets.load_tokenizer(directory, preset["tokenizer"])
    return model
