"""A tokenizer's files in a preset directory: written by `save_tokenizer`, read back by `load_tokenizer`.

The preset's `preset.json` keeps the spec `save_tokenizer` returns; `load_tokenizer` builds only the classes named
in `TOKENIZERS`, so a preset directory cannot make tfformer import or run anything else.
"""

import json
import os

from tfformer.data.bert_tokenizer import BertTokenizer, read_vocabulary
from tfformer.data.byte_pair import BytePairTokenizer
from tfformer.data.tokenizers import SubwordTokenizer
from tfformer.files import write_atomic

TOKENIZERS = ("SubwordTokenizer", "BytePairTokenizer", "BertTokenizer")
FILES = {"SubwordTokenizer": "tokenizer.model", "BytePairTokenizer": "byte_pair.json", "BertTokenizer": "vocab.txt"}


def save_tokenizer(tokenizer, directory):
    """Write `tokenizer`'s files into `directory`; returns the spec (a JSON-able dict) `load_tokenizer` reads."""
    kind = type(tokenizer).__name__
    if kind not in TOKENIZERS:
        raise ValueError(f"`tokenizer` must be one of {TOKENIZERS} to be saved in a preset. "
                         f"Received: {type(tokenizer).__module__}.{kind}")
    path = os.path.join(directory, FILES[kind])
    spec = {"class": kind, "file": FILES[kind]}
    if kind == "SubwordTokenizer":
        tokenizer.save(path)
    elif kind == "BytePairTokenizer":
        fields = dict(vocabulary=list(tokenizer.vocabulary), merges=list(tokenizer.merges),
                      special_tokens=list(tokenizer.special_tokens), pre_tokenizer=tokenizer.pre_tokenizer,
                      chat_template=tokenizer.chat_template, end_tokens=list(tokenizer.end_tokens))
        write_atomic(path, json.dumps(fields, ensure_ascii=False))
    else:
        write_atomic(path, "".join(token + "\n" for token in tokenizer.vocabulary))
        spec.update(lower_case=tokenizer.lower_case, max_length=tokenizer.max_length)
    return spec


def load_tokenizer(directory, spec):
    """The tokenizer `save_tokenizer` wrote into `directory` with `spec`."""
    kind = spec.get("class") if isinstance(spec, dict) else None
    if kind not in TOKENIZERS:
        raise ValueError(f"{directory}: the preset's tokenizer `class` must be one of {TOKENIZERS}. Received: {spec!r}")
    path = os.path.join(directory, FILES[kind])
    if not os.path.isfile(path):
        raise ValueError(f"{directory}: the preset names a {kind} but its file {FILES[kind]!r} is missing.")
    if kind == "SubwordTokenizer":
        return SubwordTokenizer.load(path)
    if kind == "BytePairTokenizer":
        with open(path, encoding="utf-8") as handle:
            return BytePairTokenizer(**json.load(handle))
    return BertTokenizer(read_vocabulary(path), lower_case=spec.get("lower_case", True),
                         max_length=spec.get("max_length", 512))
