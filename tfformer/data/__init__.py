"""Offline corpora, in-graph tokenizers and tf.data pipelines."""

from tfformer.data.corpora import gettext_pairs, read_mo, read_tsv_pairs, split_of, split_pairs, text_corpus, tfds_pairs
from tfformer.data.pipelines import make_lm_dataset, make_translation_dataset
from tfformer.data.tokenizers import END_ID, PAD_ID, START_ID, UNK_ID, SubwordTokenizer

__all__ = [
    "END_ID",
    "PAD_ID",
    "START_ID",
    "UNK_ID",
    "SubwordTokenizer",
    "gettext_pairs",
    "make_lm_dataset",
    "make_translation_dataset",
    "read_mo",
    "read_tsv_pairs",
    "split_of",
    "split_pairs",
    "text_corpus",
    "tfds_pairs",
]
