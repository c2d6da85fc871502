"""Byte-level BPE (GPT-2 family) in TensorFlow ops: one tokenizer for SmolLM2 (GGUF) and Whisper (tokenizer.json).

`tokenize` and `detokenize` are graph ops (tf-text regex splits, a hash table of merge ranks and a
`tf.while_loop`), so a SavedModel can take raw strings. Ids equal Hugging Face `tokenizers` with the same vocabulary,
merges and pre-tokenizer:

1. Special tokens are split out first (longest match wins), and never touched by the steps below.
2. Pre-tokenizer "smollm" (llama.cpp's name; HF `Digits(individual_digits=True)`): every `\\p{N}` is its own piece.
3. GPT-2's pre-tokenizer regex, on each piece:
   `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`.
   RE2 has no lookahead, so `\\s+(?!\\S)` is rebuilt: a whitespace run followed by more text gives its last
   character to the next word when it is a space (" word"), and keeps it as a piece of its own otherwise. `\\s` is
   Unicode White_Space (as in the Oniguruma regex HF uses), spelled out because RE2's `\\s` is ASCII.
4. Bytes -> byte-level symbols -> the lowest-ranked merge first (leftmost on ties), one merge per word per step,
   exactly the order of HF's BPE (`word.rs`, `merge_all`).

`detokenize` joins each token's bytes (byte-level decoding; a token whose characters are not all byte symbols, such
as a special token with a space, is taken as its own UTF-8) and replaces invalid UTF-8 with U+FFFD, as HF's decoder.

Limits: text with U+0000 is rejected (tf-text's regex split stops at it); a byte with no symbol in the vocabulary
(SmolLM2 has none for a few control characters) is dropped, as HF drops it, so such text does not round-trip. The
ops (RegexSplitWithOffsets, hash tables, while loop) are not TFLite builtins: on device, tokenize on the host.
"""

import json

import numpy as np
import tensorflow as tf
import tensorflow_text as tf_text

# Unicode White_Space: what `\s` matches in HF's Oniguruma regex (RE2's `\s` is only [\t\n\f\r ]).
WHITESPACE = r"\t\n\x{0B}\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}"
WS_RUNS = rf"[{WHITESPACE}]+|[^{WHITESPACE}]+"
WS_RUN = rf"[{WHITESPACE}]+"
# GPT-2's regex without its whitespace alternatives, for one non-space run with at most one leading space.
WORDS = rf"'s|'t|'re|'ve|'m|'ll|'d| ?\p{{L}}+| ?\p{{N}}+| ?[^{WHITESPACE}\p{{L}}\p{{N}}]+"
DIGIT = r"\p{N}"
PRE_TOKENIZERS = ("gpt2", "smollm")


def bytes_to_unicode():
    """GPT-2's byte -> printable character table (`bytes_to_unicode` in openai/gpt-2 `encoder.py`)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def _split(strings, fn):
    """Apply `fn` (flat strings (n,) -> ragged (n, None)) to a ragged (m, None) and merge: (m, None)."""
    parts = fn(strings.flat_values)  # (n, None)
    return tf.RaggedTensor.from_row_splits(parts, strings.row_splits, validate=False).merge_dims(1, 2)


def _keep_split(strings, pattern):
    return tf_text.regex_split(strings, pattern, pattern)


def _gpt2_pieces(strings):
    """GPT-2 pre-tokenization of flat strings (n,) -> ragged (n, None)."""
    runs = _keep_split(strings, WS_RUNS)  # (n, None): whitespace and non-space runs, alternating
    units = runs.flat_values  # (u,)
    is_ws = tf.strings.regex_full_match(units, WS_RUN)
    rows = runs.value_rowids()  # (u,)
    is_last = tf.range(tf.size(units, out_type=tf.int64)) == tf.gather(runs.row_splits, rows + 1) - 1
    # A whitespace run followed by text: its last character leaves the run (the lookahead of `\s+(?!\S)`).
    cut = is_ws & ~is_last
    length = tf.strings.length(units, unit="UTF8_CHAR")
    head = tf.where(cut, tf.strings.substr(units, tf.zeros_like(length), length - 1, unit="UTF8_CHAR"), units)
    tail = tf.where(cut, tf.strings.substr(units, length - 1, tf.ones_like(length), unit="UTF8_CHAR"), "")
    gives_space = tail == " "
    # A space joins the next run, which is in the same row (a cut run is never last).
    takes_space = tf.concat([[False], gives_space[:-1]], axis=0)
    head = tf.where(takes_space, tf.strings.join([" ", head]), head)
    tail = tf.where(gives_space, "", tail)
    pairs = tf.reshape(tf.stack([head, tail], axis=1), [-1])  # (2u,): head_0, tail_0, head_1, ...
    pieces = tf.RaggedTensor.from_row_splits(pairs, runs.row_splits * 2, validate=False)  # (n, None)
    pieces = tf.ragged.boolean_mask(pieces, tf.strings.length(pieces) > 0)
    # Non-space pieces split further by GPT-2's word alternatives; whitespace pieces do not match and stay whole.
    return _split(pieces, lambda flat: _keep_split(flat, WORDS))


def _first_ids(vocabulary):
    """Token -> the first id that has it (empty tokens have none)."""
    ids = {}
    for i, token in enumerate(vocabulary):
        if token:
            ids.setdefault(token, i)
    return ids


def _check_in_vocabulary(name, tokens, ids):
    for token in tokens:
        if token not in ids:
            raise ValueError(f"`{name}` entry {token!r} is not in `vocabulary`.")


def _merge_keys(merges, ids, vocabulary_size):
    """`(keys, results)`: `left_id * vocabulary_size + right_id` `(M,)` int64 of each merge `"left right"`, by rank,
    and the id of each merged token."""
    lefts, rights, results = [], [], []
    for rank, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2 or merge.startswith("#version"):
            raise ValueError(f"`merges[{rank}]` must be 'left right'; received {merge!r}.")
        left, right = parts
        for token in (left, right, left + right):
            if token not in ids:
                raise ValueError(f"`merges[{rank}]` ({merge!r}) uses {token!r}, which is not in `vocabulary`.")
        lefts.append(ids[left])
        rights.append(ids[right])
        results.append(ids[left + right])
    size = np.int64(vocabulary_size)
    keys = np.asarray(lefts, np.int64) * size + np.asarray(rights, np.int64)
    unique, first = np.unique(keys, return_index=True)
    if unique.size != keys.size:
        repeated = sorted(set(range(keys.size)) - set(first.tolist()))[0]
        raise ValueError(f"`merges[{repeated}]` ({merges[repeated]!r}) repeats an earlier merge.")
    return keys, results


def _token_bytes(vocabulary, byte_chars):
    """The bytes of each token: its symbols mapped back through `byte_chars` (`bytes_to_unicode`), or its UTF-8
    when it is not made of them (a special token)."""
    char_bytes = {c: b for b, c in byte_chars.items()}
    decoded = []
    for token in vocabulary:
        if token and all(c in char_bytes for c in token):
            decoded.append(bytes(char_bytes[c] for c in token))
        else:
            decoded.append(token.encode("utf-8"))
    return decoded


class BytePairTokenizer(tf.Module):
    """Byte-level BPE tokenizer (GPT-2, SmolLM2, Whisper) whose `tokenize`/`detokenize` are TensorFlow ops.

    Args:
        vocabulary: list of str. Token strings, index = id ("" for an unused id).
        merges: list of str. Merge rules "left right", highest priority first.
        special_tokens: list of str. Tokens matched in the raw text before pre-tokenization (chat markers, end of
            text). Each must be in `vocabulary`.
        pre_tokenizer: str. "gpt2" (GPT-2's regex) or "smollm" (every digit alone, then GPT-2's regex).
        chat_template: optional str. A Jinja chat template (`apply_chat_template`).
        end_tokens: list of str. The tokens that end a generated text (end of turn, end of text), first the one
            generation stops at (`end_id`). Each must be in `vocabulary`.
        name: str. Module name.

    Example:
    ```python
    tok = tfformer.data.BytePairTokenizer.from_gguf(path)   # SmolLM2
    ids = tok.tokenize(["Hello 2024!"])                     # tf.RaggedTensor (1, None) int32
    tok.detokenize(ids)                                     # [b"Hello 2024!"]
    tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    ```
    """

    def __init__(self, vocabulary, merges, special_tokens=(), pre_tokenizer="gpt2", chat_template=None,
                 end_tokens=(), name="byte_pair_tokenizer"):
        super().__init__(name=name)
        if pre_tokenizer not in PRE_TOKENIZERS:
            raise ValueError(f"`pre_tokenizer` must be one of {PRE_TOKENIZERS}; received {pre_tokenizer!r}.")
        vocabulary = [str(token) for token in vocabulary]
        if not vocabulary:
            raise ValueError("`vocabulary` must be a non-empty list of token strings.")
        self.vocabulary = vocabulary
        self.merges = [str(merge) for merge in merges]
        self.special_tokens = [str(token) for token in special_tokens]
        self.pre_tokenizer = pre_tokenizer
        self.chat_template = chat_template
        self.vocabulary_size = len(vocabulary)
        self.token_to_id = ids = _first_ids(vocabulary)
        _check_in_vocabulary("special_tokens", self.special_tokens, ids)
        if isinstance(end_tokens, str):
            raise ValueError(f"`end_tokens` must be a list of str. Received: end_tokens={end_tokens!r}")
        self.end_tokens = [str(token) for token in end_tokens]
        _check_in_vocabulary("end_tokens", self.end_tokens, ids)
        self.end_ids = [ids[token] for token in self.end_tokens]

        keys, results = _merge_keys(self.merges, ids, len(vocabulary))
        self.no_merge = np.int64(len(self.merges))
        self.merge_rank = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(tf.constant(keys, tf.int64), tf.constant(np.arange(keys.size))),
            default_value=self.no_merge,
        )
        self.merge_result = tf.constant(np.asarray(results + [0], np.int64))  # by rank; the extra entry: no merge
        # A byte without a symbol (SmolLM2 lacks a few control characters and the bytes UTF-8 never uses) is
        # dropped, as HF's BPE without an unknown token drops it.
        byte_chars = bytes_to_unicode()
        self.byte_ids = tf.constant([ids.get(byte_chars[b], -1) for b in range(256)], tf.int64)

        specials = sorted(set(self.special_tokens), key=len, reverse=True)  # longest first = longest match wins
        self.special_pattern = "|".join(_re2_escape(token) for token in specials)
        self.special_ids = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(specials or [""], tf.string),
                tf.constant([ids[t] for t in specials] or [-1], tf.int64),
            ),
            default_value=-1,
        )
        self.token_bytes = tf.constant(_token_bytes(vocabulary, byte_chars), tf.string)

    # --- construction -----------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata, name="byte_pair_tokenizer"):
        """From GGUF metadata (a dict, e.g. `tfformer.convert.gguf.GGUFFile(path).metadata`).

        Special tokens are the control tokens (`tokenizer.ggml.token_type` 3) and user-defined ones (4).
        """
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"`tokenizer.ggml.model` must be 'gpt2' (byte-level BPE); received {model!r}.")
        pre = metadata.get("tokenizer.ggml.pre", "gpt2")
        if pre in ("default", "gpt2"):
            pre = "gpt2"
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"`tokenizer.ggml.pre` must be one of {PRE_TOKENIZERS}; received {pre!r}.")
        if "tokenizer.ggml.tokens" not in metadata or "tokenizer.ggml.merges" not in metadata:
            raise ValueError("`metadata` must hold `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`.")
        tokens = list(metadata["tokenizer.ggml.tokens"])
        types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        specials = [t for t, kind in zip(tokens, types) if kind in (3, 4)]
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        end_tokens = [] if eos is None else [tokens[int(eos)]]
        return cls(tokens, list(metadata["tokenizer.ggml.merges"]), specials, pre,
                   metadata.get("tokenizer.chat_template"), end_tokens=end_tokens, name=name)

    @classmethod
    def from_gguf(cls, path, name="byte_pair_tokenizer"):
        """From a `.gguf` file's tokenizer metadata (`tfformer.data.gguf_header`)."""
        from tfformer.data.gguf_header import read_header

        metadata = {k: v for k, v in read_header(path).metadata.items() if k.startswith("tokenizer.")}
        return cls.from_gguf_metadata(metadata, name=name)

    @classmethod
    def from_huggingface(cls, path, chat_template=None, end_tokens=(), name="byte_pair_tokenizer"):
        """From a Hugging Face `tokenizer.json` with a BPE model and a ByteLevel pre-tokenizer (GPT-2, Whisper).

        Added tokens are the special tokens; the post-processor (e.g. Whisper's start/end tokens) is not applied.
        `end_tokens`: see the class arguments (a tokenizer.json does not say which tokens end a text).
        """
        with open(path, encoding="utf-8") as handle:
            spec = json.load(handle)
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise ValueError(f"`path` must be a tokenizer.json with a BPE model; received {model.get('type')!r}.")
        if spec.get("normalizer") is not None:
            raise ValueError(f"`path`: normalizers are not supported; received {spec['normalizer']!r}.")
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        kinds = [step.get("type") for step in steps]
        byte_level = steps[-1] if kinds and kinds[-1] == "ByteLevel" else {}
        if kinds == ["ByteLevel"]:
            pre_tokenizer = "gpt2"
        elif kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
            pre_tokenizer = "smollm"
        else:
            raise ValueError(f"`path`: the pre-tokenizer must be ByteLevel, or Digits then ByteLevel; got {kinds}.")
        if byte_level.get("add_prefix_space") or not byte_level.get("use_regex", True):
            raise ValueError("`path`: ByteLevel with add_prefix_space=True or use_regex=False is not supported.")
        if model.get("ignore_merges"):
            raise ValueError("`path`: BPE with ignore_merges=True is not supported.")
        entries = dict(model["vocab"])
        added = spec.get("added_tokens", [])
        for token in added:
            entries[token["content"]] = token["id"]
        vocabulary = [""] * (max(entries.values()) + 1)
        for token, i in entries.items():
            vocabulary[i] = token
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        specials = [t["content"] for t in added]
        return cls(vocabulary, merges, specials, pre_tokenizer, chat_template, end_tokens=end_tokens, name=name)

    # --- TensorFlow ops -----------------------------------------------------------------------------------

    def tokenize(self, texts):
        """Strings `(B,)` (or a Python list) -> `tf.RaggedTensor` `(B, None)` of int32 ids; a scalar -> `(None,)`."""
        texts = tf.convert_to_tensor(texts, dtype=tf.string)
        if texts.shape.rank == 0:
            return self.tokenize(texts[tf.newaxis])[0]
        if texts.shape.rank != 1:
            raise ValueError(f"`texts` must be a string or a 1-D batch of strings; received shape {texts.shape}.")
        has_nul = tf.reduce_any(tf.equal(tf.strings.bytes_split(texts).flat_values, "\x00"))
        tf.debugging.assert_equal(has_nul, False, message="`texts` must not contain U+0000: tf-text's regex split "
                                  "ends a string there")
        if self.special_pattern:
            pieces = _keep_split(texts, self.special_pattern)  # (B, P)
        else:
            pieces = tf.RaggedTensor.from_tensor(texts[:, tf.newaxis])  # (B, 1)
        flat = pieces.flat_values  # (P,)
        special_id = self.special_ids.lookup(flat)
        is_special = special_id >= 0
        plain = tf.RaggedTensor.from_tensor(tf.where(is_special, "", flat)[:, tf.newaxis])  # (P, 1)
        plain = tf.ragged.boolean_mask(plain, tf.strings.length(plain) > 0)
        if self.pre_tokenizer == "smollm":
            plain = _split(plain, lambda s: _keep_split(s, DIGIT))
        words = _split(plain, _gpt2_pieces)  # (P, W)
        word_ids = _split(words, self._bpe)  # (P, T): ids of every plain piece
        special = tf.ragged.boolean_mask(special_id[:, tf.newaxis], is_special[:, tf.newaxis])  # (P, 0 or 1)
        ids = tf.concat([word_ids, special], axis=1)  # (P, T): one of the two is empty in each row
        ids = tf.RaggedTensor.from_row_splits(ids, pieces.row_splits, validate=False).merge_dims(1, 2)  # (B, T)
        return tf.cast(ids, tf.int32)

    def _bpe(self, words):
        """Flat words (W,) -> ragged (W, None) of token ids, merging the best-ranked pair one step at a time."""
        symbols = tf.strings.bytes_split(words)  # (W, None) one-byte strings
        byte_values = tf.reshape(tf.io.decode_raw(symbols.flat_values, tf.uint8), [-1])  # (S,)
        symbols = symbols.with_flat_values(tf.gather(self.byte_ids, tf.cast(byte_values, tf.int32)))  # (W, None)
        symbols = tf.ragged.boolean_mask(symbols, symbols >= 0)
        values = symbols.flat_values  # (S,)
        size = tf.constant(self.vocabulary_size, tf.int64)
        num_words = tf.shape(words, out_type=tf.int64)[0]

        def step(values, row_splits, _):
            n = tf.size(values, out_type=tf.int64)
            width = n + 1  # scores rank * width + position are unique and order by (rank, position)
            rows = tf.ragged.row_splits_to_segment_ids(row_splits, out_type=tf.int64)  # (S,)
            same_row = rows[:-1] == rows[1:]  # (S-1,): pair i = (values[i], values[i+1])
            rank = tf.where(same_row, self.merge_rank.lookup(values[:-1] * size + values[1:]), self.no_merge)
            score = rank * width + tf.range(n - 1)  # (S-1,)
            best = tf.math.unsorted_segment_min(score, rows[:-1], num_words)  # (W,)
            merges = best < self.no_merge * width
            position = tf.boolean_mask(best % width, merges)  # (K,) flat index of each merged pair
            merged = tf.gather(self.merge_result, tf.boolean_mask(best // width, merges))  # (K,)
            values = tf.tensor_scatter_nd_update(values, position[:, tf.newaxis], merged)
            keep = tf.tensor_scatter_nd_update(
                tf.ones([n], tf.bool), position[:, tf.newaxis] + 1, tf.zeros_like(position, tf.bool)
            )
            values = tf.boolean_mask(values, keep)
            lengths = row_splits[1:] - row_splits[:-1] - tf.cast(merges, tf.int64)  # (W,)
            row_splits = tf.concat([[0], tf.cumsum(lengths)], axis=0)
            return values, row_splits, tf.reduce_any(merges)

        values, row_splits, _ = tf.while_loop(
            lambda values, row_splits, again: again,
            step,
            (values, tf.cast(symbols.row_splits, tf.int64), tf.constant(True)),
            shape_invariants=(tf.TensorShape([None]), tf.TensorShape([None]), tf.TensorShape([])),
        )
        return tf.RaggedTensor.from_row_splits(values, row_splits, validate=False)

    def detokenize(self, ids):
        """Ids `(B, None)` (ragged or padded) -> strings `(B,)`; a 1-D id sequence -> a scalar string.

        Every id is decoded, special tokens included (their text); drop padding before calling.
        """
        if not isinstance(ids, tf.RaggedTensor):
            ids = tf.convert_to_tensor(ids)
            if ids.shape.rank == 1:
                return self.detokenize(ids[tf.newaxis])[0]
            ids = tf.RaggedTensor.from_tensor(ids)
        ids = tf.cast(ids, tf.int64)
        tf.debugging.assert_less(ids.flat_values, tf.constant(self.vocabulary_size, tf.int64),
                                 message="`ids` must be below the vocabulary size")
        tf.debugging.assert_non_negative(ids.flat_values, message="`ids` must be non-negative")
        text = tf.strings.reduce_join(tf.gather(self.token_bytes, ids), axis=-1)  # (B,)
        return tf.strings.unicode_transcode(text, "UTF-8", "UTF-8", errors="replace", replacement_char=0xFFFD)

    # --- chat ---------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages, add_generation_prompt=True, **variables):
        """Render `chat_template` (Jinja, as Hugging Face does) for `messages`, a list of {"role", "content"}."""
        if not self.chat_template:
            raise ValueError("This tokenizer has no `chat_template`.")
        return render_chat_template(self.chat_template, messages, add_generation_prompt, **variables)


def _re2_escape(text):
    # RE2 accepts `\` before any ASCII punctuation; letters, digits and non-ASCII are literal.
    return "".join("\\" + c if c.isascii() and not c.isalnum() and c != " " else c for c in text)


def render_chat_template(template, messages, add_generation_prompt=True, **variables):
    """Render a Jinja chat template the way `transformers` does (sandboxed, trim_blocks, lstrip_blocks).

    Args:
        template: str. The template (`tokenizer.chat_template` of a GGUF, `chat_template` of tokenizer_config.json).
        messages: list of dict. Each `{"role": str, "content": str}`.
        add_generation_prompt: bool. End with the assistant's turn opener.
        **variables: further template variables (`bos_token`, `eos_token`, ...).
    """
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"`messages` must be a non-empty list of {{'role', 'content'}} dicts; received {messages!r}.")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content"} or "role" not in message \
                or "content" not in message:
            raise ValueError(
                f"`messages[{i}]` must be a dict with exactly the keys 'role' and 'content'; received {message!r}."
            )
        for key in ("role", "content"):
            if not isinstance(message[key], str):
                raise ValueError(f"`messages[{i}]['{key}']` must be a string; received {message[key]!r}.")
        if not message["role"]:
            raise ValueError(f"`messages[{i}]['role']` must be non-empty.")

    def raise_exception(text):
        raise ValueError(f"the chat template rejected `messages`: {text}")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    environment.globals["raise_exception"] = raise_exception
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    variables = {"bos_token": "", "eos_token": "", **variables}
    return environment.from_string(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
    )
