"""BERT's WordPiece tokenizer in the TensorFlow graph, matching Hugging Face."""

import keras
import tensorflow as tf
import tensorflow_text as tf_text

from tfformer.checks import check_int

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

# Hugging Face's BertNormalizer (the Rust `tokenizers` one every BERT
# checkpoint uses), written as RE2 patterns. `\t\n\r` are whitespace, not
# control characters, so the first group keeps them before the control
# class (Cc, Cf, Co, Cs, U+FFFD; NUL is Cc) drops the rest.
_CONTROL = r"([\t\n\r])|[\p{Cc}\p{Cf}\p{Co}\p{Cs}\x{FFFD}]"
# Rust `char::is_whitespace`, less the ones that are control characters.
_WHITESPACE = r"[\t\n\r \x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}]"
# CJK ideographs get spaces around them. 0x2B920 (not 0x2B820, Google's
# original) is the start of the Extension E range in `tokenizers`; we match it.
_CJK = (
    r"[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2B73F}"
    r"\x{2B740}-\x{2B81F}\x{2B920}-\x{2CEAF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}]"
)
# ASCII punctuation (symbols included) and Unicode P*: each is its own word.
_PUNCTUATION = r"[!-/:-@\[-`{-~\p{P}]"
# Private-use characters stand in for special tokens while the text is split:
# normalisation removes every private-use character from ordinary text.
_PLACEHOLDER_BASE = 0xE000


@keras.saving.register_keras_serializable(package="tfformer")
class BertTokenizer(tf.Module):
    """BERT tokenization in the graph: text to `[CLS] wordpieces [SEP]` ids.

    Reproduces Hugging Face's `BertTokenizerFast` (the `tokenizers` library)
    with TensorFlow and tensorflow-text ops, so it runs inside a
    `tf.function` and exports with a SavedModel:

    1. Special tokens written in the text (`"[SEP]"`) are kept whole, as
       Hugging Face does for its added tokens.
    2. Basic tokenization: control characters are dropped, whitespace becomes
       a space, CJK ideographs are split apart; with `lower_case`, NFD, accents
       (`Mn`) stripped, then lower-cased (no final-sigma rule, as in Rust).
       Then the text is split on whitespace and punctuation.
    3. WordPiece (`tf_text.FastWordpieceTokenizer`): greedy longest match,
       `##` continuations; a word with no match, or longer than 100
       characters, becomes `[UNK]`.
    4. Truncation to `max_length` including `[CLS]` and `[SEP]`, right
       padding with id 0.

    `tf_text.BertTokenizer` and `tf_text.FastBertTokenizer` are not used
    because they lower-case with NFKC case folding: "ß", "…", "™", "ﬁ",
    full-width letters and control characters come out differently from
    Hugging Face. What remains different, measured one code point at a time:
    568 of the 1,111,998 code points get other ids, nearly all marks and
    punctuation added or re-categorised since Unicode 9, which the Rust
    category tables predate and ICU/RE2 know.

    Args:
        vocabulary: list of str. One token per id; must hold `[UNK]`, `[CLS]`
            and `[SEP]`, and `[PAD]` at id 0.
        lower_case: bool. Lower-case and strip accents (uncased models).
            Defaults to `True`.
        max_length: int. Longest output, `[CLS]` and `[SEP]` included.
            Defaults to `512`.
        name: str. Module name.

    Call arguments:
        inputs: list of str, or a 1-D `tf.string` tensor `(B,)`.

    Returns:
        `{"token_ids": int32 (B, T), "padding_mask": int32 (B, T)}`, `T` the
        longest sequence in the batch; `padding_mask` is 1 on real tokens.

    Example:
    ```python
    tokenizer = tfformer.data.BertTokenizer.from_vocabulary("vocab.txt", max_length=256)
    tokenizer(["Hello, world!"])["token_ids"]  # [[101, 7592, 1010, 2088, 999, 102]]
    ```
    """

    def __init__(self, vocabulary, lower_case=True, max_length=512, name=None):
        super().__init__(name=name)
        vocabulary = [str(token) for token in vocabulary]
        for token in ("[UNK]", "[CLS]", "[SEP]"):
            if token not in vocabulary:
                raise ValueError(f"`vocabulary` must contain {token!r}. Received {len(vocabulary)} tokens without it.")
        if not vocabulary or vocabulary[0] != "[PAD]":
            first = vocabulary[0] if vocabulary else None
            raise ValueError(
                f"`vocabulary` must have '[PAD]' at id 0 (tfformer pads with 0). Received: {first!r} at id 0"
            )
        check_int("max_length", max_length, minimum=2, expected="an integer >= 2 ([CLS] and [SEP])")
        self._vocabulary = tuple(vocabulary)
        self.lower_case = bool(lower_case)
        self.max_length = max_length
        self.cls_id = vocabulary.index("[CLS]")
        self.sep_id = vocabulary.index("[SEP]")
        self.special_tokens = tuple(token for token in SPECIAL_TOKENS if token in vocabulary)
        self._wordpiece = tf_text.FastWordpieceTokenizer(
            vocab=vocabulary,
            suffix_indicator="##",
            # Hugging Face's limit is 100 *characters*; we apply it ourselves
            # and let any word of up to 100 4-byte characters through here.
            max_bytes_per_word=400,
            token_out_type=tf.int32,
            unknown_token="[UNK]",
            no_pretokenization=True,
        )

    @property
    def vocabulary(self):
        return list(self._vocabulary)

    @property
    def vocabulary_size(self):
        return len(self._vocabulary)

    @classmethod
    def from_vocabulary(cls, vocab_path, lower_case=True, max_length=512):
        """A tokenizer from a `vocab.txt` (one token per line, id = line number)."""
        return cls(read_vocabulary(vocab_path), lower_case=lower_case, max_length=max_length)

    # === Basic tokenization ===
    def _normalize(self, text):
        text = tf.strings.regex_replace(text, _CONTROL, r"\1")
        text = tf.strings.regex_replace(text, _WHITESPACE, " ")
        text = tf.strings.regex_replace(text, f"({_CJK})", r" \1 ")
        if self.lower_case:
            # ICU lower-cases a word-final capital sigma to "ς"; Rust gives "σ".
            text = tf.strings.regex_replace(text, "\u03a3", "\u03c3")
            text = tf_text.normalize_utf8(text, "NFD")
            text = tf.strings.regex_replace(text, r"\p{Mn}", "")
            text = tf.strings.lower(text, encoding="utf-8")
        return text

    def _words(self, text):
        """Words of each text, `(B, W)` ragged strings, special tokens kept whole."""
        specials = "|".join(_escape(token) for token in self.special_tokens)
        # regex_split stops at a NUL byte; U+0001 is dropped by normalisation just the same.
        text = tf.strings.regex_replace(text, "\x00", "\x01")
        segments = tf_text.regex_split(text, specials, specials)  # (B, S) ragged
        flat = segments.flat_values
        placeholders = [chr(_PLACEHOLDER_BASE + i) for i in range(len(self.special_tokens))]
        normalized = self._normalize(flat)
        for token, placeholder in zip(self.special_tokens, placeholders):
            normalized = tf.where(flat == token, placeholder, normalized)
        words = tf_text.regex_split(normalized, f" +|{_PUNCTUATION}", _PUNCTUATION)  # (S_total, W) ragged
        words = segments.with_flat_values(words).merge_dims(1, 2)  # (B, W)
        flat_words = words.flat_values
        for token, placeholder in zip(self.special_tokens, placeholders):
            flat_words = tf.where(flat_words == placeholder, token, flat_words)
        too_long = tf.strings.length(flat_words, unit="UTF8_CHAR") > 100
        return words.with_flat_values(tf.where(too_long, "[UNK]", flat_words))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def tokenize(self, text):
        """WordPiece ids without `[CLS]`/`[SEP]` and untruncated, `(B, N)` ragged int32."""
        pieces = self._wordpiece.tokenize(self._words(text))  # (B, W, P)
        return pieces.merge_dims(1, 2)  # (B, N)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def _pack(self, text):
        ids = self.tokenize(text)[:, : self.max_length - 2]  # (B, N <= max_length - 2)
        batch = ids.nrows()
        cls = tf.fill([batch, 1], self.cls_id)
        sep = tf.fill([batch, 1], self.sep_id)
        ids = tf.concat([cls, ids, sep], axis=1)  # (B, N + 2) ragged
        token_ids = ids.to_tensor(default_value=0)  # (B, T)
        padding_mask = tf.sequence_mask(ids.row_lengths(), tf.shape(token_ids)[1], dtype=tf.int32)  # (B, T)
        return {"token_ids": token_ids, "padding_mask": padding_mask}

    def __call__(self, inputs):
        expected = "`inputs` must be a list of strings or a 1-D tf.string tensor."
        if isinstance(inputs, (str, bytes)):
            raise ValueError(f"{expected} Received a single string; wrap it in a list.")
        if not isinstance(inputs, tf.Tensor):
            texts = list(inputs)
            if not all(isinstance(x, (str, bytes)) for x in texts):
                raise ValueError(f"{expected} Received: {texts!r:.200}")
            texts = [x.encode("utf-8") if isinstance(x, str) else x for x in texts]
            inputs = tf.constant(texts, dtype=tf.string, shape=[len(texts)])
        elif inputs.dtype != tf.string or inputs.shape.rank != 1:
            raise ValueError(f"{expected} Received: dtype={inputs.dtype.name}, shape={inputs.shape}")
        return self._pack(inputs)

    def get_config(self):
        return {
            "vocabulary": self.vocabulary,
            "lower_case": self.lower_case,
            "max_length": self.max_length,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def read_vocabulary(vocab_path):
    """Tokens of a `vocab.txt`, one per line.

    Lines end at "\n" only (as in Hugging Face): `str.splitlines` would also
    break at U+0085 or U+2028, which multilingual vocabularies contain.
    """
    with open(vocab_path, encoding="utf-8", newline="") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _escape(token):
    return "".join(f"\\{c}" if not c.isalnum() else c for c in token)
