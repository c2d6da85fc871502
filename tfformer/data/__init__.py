"""Offline corpora, in-graph tokenizers, audio features and tf.data pipelines."""

from tfformer.data import assets, placeholders  # placeholders.mask / restore; assets.save_tokenizer / load_tokenizer
from tfformer.data.bert_tokenizer import BertTokenizer
from tfformer.data.audio import log_mel_spectrogram, mel_filters, prepare_waveform, read_wav, split_windows
from tfformer.data.byte_pair import BytePairTokenizer, render_chat_template
from tfformer.data.corpora import gettext_pairs, read_mo, read_tsv_pairs, split_of, split_pairs, text_corpus, tfds_pairs
from tfformer.data.pipelines import (
    make_chat_dataset,
    make_lm_dataset,
    make_text_file_dataset,
    make_translation_dataset,
    read_chat_tsv,
)
from tfformer.data.tokenizers import SubwordTokenizer
from tfformer.tokens import END_ID, PAD_ID, START_ID, UNK_ID

__all__ = [
    "assets",
    "placeholders",
    "END_ID",
    "PAD_ID",
    "START_ID",
    "UNK_ID",
    "BertTokenizer",
    "BytePairTokenizer",
    "SubwordTokenizer",
    "gettext_pairs",
    "log_mel_spectrogram",
    "make_chat_dataset",
    "make_lm_dataset",
    "make_text_file_dataset",
    "make_translation_dataset",
    "mel_filters",
    "prepare_waveform",
    "read_chat_tsv",
    "read_mo",
    "read_wav",
    "render_chat_template",
    "read_tsv_pairs",
    "split_of",
    "split_pairs",
    "split_windows",
    "text_corpus",
    "tfds_pairs",
]
