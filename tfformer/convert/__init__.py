"""Pretrained checkpoints into tfformer models: Hugging Face BERT, sentence-transformers.

Imports `models` and `layers`, never `training`, `data` or the CLI.
"""

from tfformer.convert.bert_tokenizer import BertTokenizer
from tfformer.convert.huggingface import from_huggingface
from tfformer.convert.pretrained import load_all_minilm_l6_v2
from tfformer.convert.sentence_transformers import from_sentence_transformers, tokenizer_from_huggingface

__all__ = [
    "BertTokenizer",
    "from_huggingface",
    "from_sentence_transformers",
    "load_all_minilm_l6_v2",
    "tokenizer_from_huggingface",
]
