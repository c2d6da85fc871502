"""Offline corpora, in-graph tokenizers, audio features and tf.data pipelines."""

from tfformer.data import placeholders  # mask / restore: tfformer.data.placeholders.mask
from tfformer.data.audio import log_mel_spectrogram, mel_filters, prepare_waveform, read_wav
from tfformer.data.byte_pair import BytePairTokenizer, render_chat_template
from tfformer.data.corpora import gettext_pairs, read_mo, read_tsv_pairs, split_of, split_pairs, text_corpus, tfds_pairs
from tfformer.data.pipelines import make_lm_dataset, make_translation_dataset
from tfformer.data.tokenizers import END_ID, PAD_ID, START_ID, UNK_ID, SubwordTokenizer

__all__ = [
    "END_ID",
    "PAD_ID",
    "START_ID",
    "UNK_ID",
    "BytePairTokenizer",
    "SubwordTokenizer",
    "gettext_pairs",
    "log_mel_spectrogram",
    "make_lm_dataset",
    "make_translation_dataset",
    "mel_filters",
    "prepare_waveform",
    "read_mo",
    "read_wav",
    "render_chat_template",
    "read_tsv_pairs",
    "split_of",
    "split_pairs",
    "text_corpus",
    "tfds_pairs",
]
