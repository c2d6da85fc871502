"""Pretrained checkpoints into tfformer models: Hugging Face BERT, sentence-transformers, GGUF (SmolLM2),
CTranslate2 (Whisper).

Imports `models` and `layers`, never `training`, `data` or the CLI.
"""

from tfformer.data.bert_tokenizer import BertTokenizer
from tfformer.convert.huggingface import from_huggingface
from tfformer.convert.pretrained import load_all_minilm_l6_v2
from tfformer.convert.sentence_transformers import from_sentence_transformers, tokenizer_from_huggingface
from tfformer.convert.smollm2 import load_smollm2_135m_instruct
from tfformer.convert.whisper import from_ctranslate2_whisper, load_whisper_tiny_en

__all__ = [
    "BertTokenizer",
    "from_ctranslate2_whisper",
    "from_huggingface",
    "from_sentence_transformers",
    "load_all_minilm_l6_v2",
    "load_smollm2_135m_instruct",
    "load_whisper_tiny_en",
    "tokenizer_from_huggingface",
]
