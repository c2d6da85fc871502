"""Subword tokenization, in-graph with tensorflow-text.

Scheme: a SentencePiece unigram model learned from the training split
(`sentencepiece`'s trainer: seconds, not minutes), run in the graph by
`tensorflow_text.FastSentencepieceTokenizer`, whose ops also run in TFLite
with the TF-Text registrar. Why this one:

- Exact round trip. Normalisation is the identity, runs of spaces are kept
  (`remove_extra_whitespaces=False`), no dummy prefix is added, and the
  whitespace SentencePiece would fold (tab, newline, carriage return) is mapped
  to reserved symbols (U+2409, U+240A, U+240D) before tokenization and back
  after, so `detokenize(tokenize(s)) == s` for every string whose characters
  were seen in training (`character_coverage=1.0`), but for those three symbols
  and U+2581 (SentencePiece's space) written literally. Format specifiers such as
  `%s`, `%d` and `'%s'` are ordinary pieces.
- No WordPiece: it would need every kind of whitespace mapped to symbols and
  learns slower (keras-hub's trainer took 535 s on this corpus).
- FastSentencepiece has no byte fallback: an unseen character becomes id 1
  (`<unk>`) and detokenizes to " ⁇ ".

Reserved ids: 0 padding, 1 unknown, 2 start, 3 end. The first
`min(placeholders.NUM_RESERVED_SYMBOLS, vocabulary_size // 16)` characters that `tfformer.data.placeholders`
masks placeholders to are pieces of their own.
"""

import io
import os

import sentencepiece
import tensorflow as tf
import tensorflow_text as tf_text

from tfformer.checks import check_int
from tfformer.data.placeholders import RESERVED_SYMBOLS
from tfformer.tokens import END_ID, PAD_ID, START_ID, UNK_ID

ESCAPES = (("\t", "\u2409"), ("\n", "\u240a"), ("\r", "\u240d"))


def _escape(texts):
    for raw, symbol in ESCAPES:
        texts = tf.strings.regex_replace(texts, raw, symbol)
    return texts


def _unescape(texts):
    for raw, symbol in ESCAPES:
        texts = tf.strings.regex_replace(texts, symbol, raw)
    return texts


class SubwordTokenizer(tf.Module):
    """A SentencePiece tokenizer that runs in the TensorFlow graph (and in tf.data, SavedModel, TFLite).

    Args:
        model_proto: bytes of a trained SentencePiece model (`SubwordTokenizer.train`).

    Example:
    ```python
    tok = tfformer.data.SubwordTokenizer.train(["Hello %s!", "Open file"], vocabulary_size=40)
    ids = tok.tokenize(["Hello %s!"])      # tf.RaggedTensor of int32
    tok.detokenize(ids)                     # [b"Hello %s!"]
    ```
    """

    def __init__(self, model_proto, name="subword_tokenizer"):
        super().__init__(name=name)
        if not isinstance(model_proto, (bytes, bytearray)) or not model_proto:
            raise ValueError("`model_proto` must be the non-empty bytes of a SentencePiece model.")
        self.model_proto = bytes(model_proto)
        self._tokenizer = tf_text.FastSentencepieceTokenizer(self.model_proto)
        self.vocabulary_size = int(self._tokenizer.vocab_size())

    @classmethod
    def train(cls, texts, vocabulary_size=8192, num_threads=2):
        """Learn a unigram vocabulary of at most `vocabulary_size` pieces from an iterable of strings."""
        check_int("vocabulary_size", vocabulary_size, minimum=8)
        texts = [_escape_py(t) for t in texts if t]
        if not texts:
            raise ValueError("Cannot learn a vocabulary from no text: `texts` is empty.")
        model = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_writer=model,
            vocab_size=vocabulary_size,
            hard_vocab_limit=False,  # small corpora get a smaller vocabulary instead of an error
            model_type="unigram",
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=False,
            byte_fallback=False,  # FastSentencepiece does not implement it
            character_coverage=1.0,
            # Masked placeholders (tfformer.data.placeholders) are single pieces the model can learn to copy;
            # fewer of them in tiny vocabularies, which must still hold every character.
            user_defined_symbols=[symbol for _, symbol in ESCAPES]
            + list(RESERVED_SYMBOLS[: vocabulary_size // 16]),
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=START_ID,
            eos_id=END_ID,
            max_sentence_length=16384,
            num_threads=num_threads,
            minloglevel=2,
        )
        return cls(model.getvalue())

    def tokenize(self, texts):
        """Strings `(B,)` (or a Python list) -> `tf.RaggedTensor` `(B, None)` of int32 ids."""
        texts = tf.convert_to_tensor(texts, dtype=tf.string)
        return tf.cast(self._tokenizer.tokenize(_escape(texts)), tf.int32)

    def detokenize(self, ids):
        """Ids `(B, None)` (ragged or padded) -> strings `(B,)`. Padding, start and end ids are dropped.

        Tabs and line breaks travel as the symbols U+2409, U+240A, U+240D (`ESCAPES`), which come back as tabs and
        line breaks: those symbols themselves, and SentencePiece's U+2581, do not round-trip."""
        if not isinstance(ids, tf.RaggedTensor):
            ids = tf.RaggedTensor.from_tensor(tf.convert_to_tensor(ids))
        ids = tf.cast(ids, tf.int32)
        # Else SentencePiece's op fails with "InternalError: Sentencepiece conversion failed". `train` may learn
        # fewer pieces than asked (a model sized to the request can emit ids past them).
        tf.debugging.assert_less(ids.flat_values, self.vocabulary_size,
                                 message=f"`ids` must be below the vocabulary size {self.vocabulary_size}")
        tf.debugging.assert_non_negative(ids.flat_values, message="`ids` must be non-negative")
        keep = (ids != PAD_ID) & (ids != START_ID) & (ids != END_ID)
        return _unescape(self._tokenizer.detokenize(tf.ragged.boolean_mask(ids, keep)))

    def tokenize_for_tflite(self, texts):
        """`tokenize` with only TF-Text TFLite registrar ops: tab/newline escaping is skipped
        (it needs regex ops), so those characters tokenize as the model's unknown piece."""
        return tf.cast(self._tokenizer.tokenize(texts), tf.int32)

    def detokenize_for_tflite(self, ids):
        """`detokenize` with registrar ops only, for one sequence: ids `(1, T)`; ids 0-3 are dropped."""
        flat = tf.reshape(tf.cast(ids, tf.int32), [-1])
        kept = tf.boolean_mask(flat, flat > END_ID)
        splits = tf.stack([0, tf.size(kept)])  # int32 splits: the TFLite kernel reads them as int32
        return self._tokenizer.detokenize(tf.RaggedTensor.from_row_splits(kept, splits, validate=False))

    def id_to_piece(self, ids):
        """The vocabulary pieces of `ids` (a Python list of str; for display, e.g. attention plots)."""
        processor = sentencepiece.SentencePieceProcessor(model_proto=self.model_proto)
        return [processor.id_to_piece(int(i)) for i in ids]

    def save(self, path):
        """Write the SentencePiece model file (the tokenizer's only state)."""
        with open(path, "wb") as handle:
            handle.write(self.model_proto)
        return path

    @classmethod
    def load(cls, path):
        if not os.path.isfile(path):
            raise ValueError(f"Tokenizer file {path!r} does not exist.")
        with open(path, "rb") as handle:
            return cls(handle.read())


def _escape_py(text):
    for raw, symbol in ESCAPES:
        text = text.replace(raw, symbol)
    return text
