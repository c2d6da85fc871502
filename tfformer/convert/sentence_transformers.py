"""sentence-transformers model directories into `SentenceEncoder`.

Such a directory holds a BERT checkpoint plus `modules.json` (the pipeline:
Transformer, Pooling, optionally Normalize), `1_Pooling/config.json` and
`sentence_bert_config.json` (`max_seq_length`).
"""

import json
import os

from tfformer.data.bert_tokenizer import BertTokenizer
from tfformer.convert.huggingface import from_huggingface
from tfformer.models.sentence_encoder import SentenceEncoder

MODULES = "sentence_transformers.models."
DEFAULT_MAX_LENGTH = 512


def _read_json(path, default=None):
    if not os.path.isfile(path):
        if default is not None:
            return default
        raise ValueError(f"{path} not found.")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from None


def tokenizer_from_huggingface(path, max_length=None):
    """The `BertTokenizer` of a checkpoint dir: `vocab.txt` + `tokenizer_config.json`.

    `max_length` defaults to `max_seq_length` of `sentence_bert_config.json`
    when present, else 512.
    """
    path = os.fspath(path)
    vocab_path = os.path.join(path, "vocab.txt")
    if not os.path.isfile(vocab_path):
        raise ValueError(f"{vocab_path} not found: only WordPiece (vocab.txt) tokenizers are supported.")
    config_path = os.path.join(path, "tokenizer_config.json")
    config = _read_json(config_path, default={})
    lower_case = config.get("do_lower_case", True)
    strip_accents = config.get("strip_accents")
    if strip_accents is not None and strip_accents != lower_case:
        raise ValueError(
            f"{config_path}: `strip_accents` must be null or equal to do_lower_case. "
            f"Received: strip_accents={strip_accents!r}"
        )
    if not config.get("tokenize_chinese_chars", True):
        raise ValueError(f"{config_path}: `tokenize_chinese_chars` must be true. Received: false")
    if max_length is None:
        sbert = _read_json(os.path.join(path, "sentence_bert_config.json"), default={})
        max_length = sbert.get("max_seq_length") or DEFAULT_MAX_LENGTH
    return BertTokenizer.from_vocabulary(vocab_path, lower_case=lower_case, max_length=max_length)


def from_sentence_transformers(path, name=None, dtype=None):
    """A `SentenceEncoder` (weights and tokenizer) from a sentence-transformers dir.

    Supports the BERT recipe of all-MiniLM and friends: a BERT `Transformer`,
    mean `Pooling`, and an optional `Normalize`.

    Example:
    ```python
    model = tfformer.convert.from_sentence_transformers("all-MiniLM-L6-v2/")
    model.encode(["A sentence."])  # (1, 384)
    ```
    """
    path = os.fspath(path)
    modules_path = os.path.join(path, "modules.json")
    modules = _read_json(modules_path)
    types = [module.get("type", "").removeprefix(MODULES) for module in modules]
    if types not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise ValueError(f"{modules_path}: modules must be Transformer, Pooling[, Normalize]. Received: {types}")
    transformer_path = os.path.join(path, modules[0].get("path", ""))
    pooling_path = os.path.join(path, modules[1].get("path", ""), "config.json")
    pooling = _read_json(pooling_path)
    modes = sorted(key for key, value in pooling.items() if key.startswith("pooling_mode") and value)
    if modes != ["pooling_mode_mean_tokens"]:
        raise ValueError(f"{pooling_path}: only mean pooling is supported. Received: {modes}")
    sbert_path = os.path.join(transformer_path, "sentence_bert_config.json")
    sbert = _read_json(sbert_path, default={})
    encoder = from_huggingface(transformer_path, dtype=dtype)
    tokenizer = tokenizer_from_huggingface(transformer_path)
    if sbert.get("do_lower_case") and not tokenizer.lower_case:
        raise ValueError(f"{sbert_path}: `do_lower_case` is only supported for uncased tokenizers.")
    if tokenizer.max_length > encoder.config.max_sequence_length:
        raise ValueError(
            f"{sbert_path}: max_seq_length={tokenizer.max_length} exceeds max_position_embeddings="
            f"{encoder.config.max_sequence_length}."
        )
    if tokenizer.vocabulary_size != encoder.config.vocabulary_size:
        raise ValueError(
            f"{os.path.join(transformer_path, 'vocab.txt')} has {tokenizer.vocabulary_size} tokens but the "
            f"model has {encoder.config.vocabulary_size} embeddings."
        )
    return SentenceEncoder(encoder, tokenizer=tokenizer, normalize=types[-1] == "Normalize", name=name)
