"""Placeholder protection for translation: what a program needs from a message survives by construction.

`mask` turns a message into what the model sees; `restore` turns whatever the model emitted back into a message
that holds every placeholder of the source exactly once:

- The leading and trailing whitespace of the message (`\\n`, spaces, tabs) is cut off and put back verbatim.
- Placeholders become reserved characters, one per occurrence, numbered in order: U+E000 for the first,
  U+E001 for the second, ... (Unicode's private use area; `RESERVED_SYMBOLS` are single tokenizer pieces).
  Placeholders are printf conversions as GNU gettext's c-format reads them (`%s`, `%.2f`, `%1$s`, `%'d`, `%lu`,
  `%%`, `%<PRIu64>`), python-format (`%(name)s`), Python brace fields (`{name}`, `{0:>3}`, `{{`), XML/HTML
  tags and entities, any other `%`, `{`, `}`, `<`, `>`, and private-use characters already in the source.
- A keyboard accelerator mark (`_File`, `&File`: `_` or `&` before a letter at the start of a word) is removed.

`restore(masked, output)`:
1. deletes placeholders the model wrote out as text and accelerator marks (the only true ones are the masked ones),
   and the output's leading/trailing whitespace;
2. keeps the first occurrence of each reserved character of the source and drops repeats and unknown ones;
3. appends the missing ones at the end of the text, each after a space, in source order;
4. strips leading/trailing whitespace again; if nothing is left, takes the masked source text instead (msgfmt
   rejects a "\\n" msgstr for "Done.\\n", and an empty one tells the translator nothing); puts the accelerator
   mark before the first letter (at the start if there is none);
5. replaces the reserved characters with the placeholders. Printf conversions without an argument number
   (`%s`, `%d`: their order is the order of the arguments) are written in source order, at the positions where the
   model put any of them; numbered (`%1$s`), named (`%(n)s`, `{n}`) ones and tags stay where the model put them;
6. adds the source's leading and trailing whitespace.

A message with nothing to translate (only placeholders, digits, punctuation and whitespace: `"%s: %s\\n"`) is copied
as it is (`Masked.translatable` is False).

Every step is also written with `tf.strings` ops (`mask_tf`, `restore_tf`) for the exported SavedModel; the
patterns below use only syntax that Python's `re` and RE2 read the same way (no lookarounds, no `\\w`/`\\d`/`\\s`,
whose meaning differs), and tests check that both give the same strings. U+0001 serves as a separator inside
`mask_tf`, so it is replaced by U+FFFD in the text the model sees (both ways alike).
"""

import dataclasses
import re

BASE = 0xE000
MAX_PLACEHOLDERS = 0xF900 - BASE  # the whole BMP private use area
NUM_RESERVED_SYMBOLS = 32
RESERVED_SYMBOLS = tuple(chr(BASE + i) for i in range(NUM_RESERVED_SYMBOLS))

_WS = " \t\n\r\f\v"
_WS_CLASS = r" \t\n\r\f\v"
_PUA = "\ue000-\uf8ff"  # literal characters: both engines read them in a class
# Letters an accelerator mark can stand before (Latin, Greek, Cyrillic), as explicit ranges for both engines.
_LETTER = "A-Za-z\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u024f\u0370-\u03ff\u0400-\u04ff"
# A text needs the model iff it has a character that is not whitespace, ASCII digit/punctuation or reserved.
_TRANSLATABLE = f"[^{_WS_CLASS}\\x21-\\x40\\x5b-\\x60\\x7b-\\x7e{_PUA}]"

_STAR = r"\*(?:[0-9]+\$)?"
_C_BODY = (rf"[-+ #0'I]*(?:[0-9]+|{_STAR})?(?:\.(?:[0-9]+|{_STAR})?)?(?:hh|h|ll|l|L|q|j|z|Z|t)?"
           r"(?:[diouxXeEfFgGaAcsCSpnm]|<PRI[A-Za-z0-9_]+>)")
_ORDERED = "%" + _C_BODY  # printf conversions without an argument number: their order is fixed
_RAW = "|".join([
    r"%%",
    r"%\([^)]*\)[-+ #0]*(?:[0-9]+|\*)?(?:\.(?:[0-9]+|\*)?)?[hlL]?[diouxXeEfFgGcrsa%]",  # python-format
    r"%(?:[0-9]+\$)?" + _C_BODY,  # c-format
    r"\{\{|\}\}|\{[A-Za-z0-9_.\[\]]*(?:![rsa])?(?::[^{}]*)?\}",  # python-brace-format
    r"</?[A-Za-z][^<>]*>",  # XML/HTML tags
    r"&(?:[A-Za-z][A-Za-z0-9]*|#[0-9]+|#[xX][0-9A-Fa-f]+);",  # entities
    r"[%{}<>]",  # a lone one: kept from the source, and a model's own removed (it could join a restored one)
])
_PLACEHOLDER = _RAW + f"|[{_PUA}]"
_ACCEL = f"(^|[{_WS_CLASS}(\\[\"'])([_&])([{_LETTER}])"

_EDGES_PY = re.compile(f"([{_WS_CLASS}]*)(.*?)([{_WS_CLASS}]*)", re.S)
_SPLIT_PY = re.compile(f"({_PLACEHOLDER})")
_RAW_PY = re.compile(_RAW)
_ACCEL_PY = re.compile(_ACCEL)
_LETTER_PY = re.compile(f"[{_LETTER}]")
_TRANSLATABLE_PY = re.compile(_TRANSLATABLE)
_ORDERED_PY = re.compile(_ORDERED)
_PLACEHOLDER_PY = re.compile(_PLACEHOLDER)

_EDGES_RE2 = f"(?s)^([{_WS_CLASS}]*)(.*?)([{_WS_CLASS}]*)$"
_STRIP_RE2 = f"^[{_WS_CLASS}]+|[{_WS_CLASS}]+$"


@dataclasses.dataclass(frozen=True)
class Masked:
    """A message as the model sees it (`text`) and what `restore` needs to rebuild it."""

    source: str
    text: str
    prefix: str
    suffix: str
    placeholders: tuple
    accelerator: str

    @property
    def translatable(self):
        return bool(_TRANSLATABLE_PY.search(self.text))


def find_placeholders(text):
    """The placeholders of `text` in order (what `mask` protects besides whitespace and the accelerator mark)."""
    return _PLACEHOLDER_PY.findall(text)


def is_ordered(placeholder):
    """True for printf conversions whose position in the argument list is their order (`%s`, not `%1$s`)."""
    return placeholder != "%%" and _ORDERED_PY.fullmatch(placeholder) is not None


def mask(text):
    """`Masked` form of one message (see the module docstring)."""
    if not isinstance(text, str):
        raise ValueError(f"`text` must be a str. Received: {type(text).__name__}")
    prefix, core, suffix = _EDGES_PY.fullmatch(text).groups()
    pieces = _SPLIT_PY.split(core.replace("\x01", "\ufffd"))  # text, placeholder, text, ..., text
    placeholders = tuple(pieces[1::2])
    if len(placeholders) > MAX_PLACEHOLDERS:
        raise ValueError(f"`text` holds {len(placeholders)} placeholders; at most {MAX_PLACEHOLDERS} can be masked.")
    masked = "".join(piece if k % 2 == 0 else chr(BASE + k // 2) for k, piece in enumerate(pieces))
    accelerator = ""
    match = _ACCEL_PY.search(masked)
    if match:
        accelerator = match.group(2)
        masked = masked[: match.start(2)] + masked[match.end(2):]
    return Masked(text, masked, prefix, suffix, placeholders, accelerator)


def restore(masked, output):
    """The message for model `output` (a str): every placeholder of `masked.source` exactly once (see above)."""
    if not masked.translatable:
        return masked.source
    n = len(masked.placeholders)
    output = _ACCEL_PY.sub(r"\1\3", _RAW_PY.sub("", output)).strip(_WS)
    seen, chars = set(), []
    for char in output:
        index = ord(char) - BASE
        if 0 <= index < MAX_PLACEHOLDERS:
            if index < n and index not in seen:
                seen.add(index)
                chars.append(char)
            continue
        chars.append(char)
    core = "".join(chars) + "".join(" " + chr(BASE + i) for i in range(n) if i not in seen)
    core = core.strip(_WS) or masked.text  # nothing left: the source text, not an empty message
    if masked.accelerator:
        match = _LETTER_PY.search(core)
        at = match.start() if match else 0
        core = core[:at] + masked.accelerator + core[at:]
    ordered = iter([i for i, p in enumerate(masked.placeholders) if is_ordered(p)])
    pieces = []
    for char in core:
        index = ord(char) - BASE
        if 0 <= index < MAX_PLACEHOLDERS:
            if is_ordered(masked.placeholders[index]):
                index = next(ordered)
            pieces.append(masked.placeholders[index])
        else:
            pieces.append(char)
    return masked.prefix + "".join(pieces) + masked.suffix


# ----------------------------------------------------------------------------------------------------------------
# The same in TensorFlow ops (SavedModel string signatures).


def mask_tf(texts):
    """`mask` for a batch of strings `(B,)` in graph ops.

    Returns a dict of `source`, `text` (what the model sees), `prefix`, `suffix`, `accelerator` and `translatable`
    `(B,)`, and `placeholders` `(B, None)` (a `tf.RaggedTensor`), the input of `restore_tf`.
    """
    import tensorflow as tf

    texts = tf.convert_to_tensor(texts, tf.string)
    prefix = tf.strings.regex_replace(texts, _EDGES_RE2, r"\1")
    core = tf.strings.regex_replace(texts, _EDGES_RE2, r"\2")
    suffix = tf.strings.regex_replace(texts, _EDGES_RE2, r"\3")
    core = tf.strings.regex_replace(core, "\x01", "\ufffd")
    # Each placeholder between two U+0001, then split: pieces alternate text, placeholder, ..., text.
    pieces = tf.strings.split(tf.strings.regex_replace(core, _PLACEHOLDER, "\x01\\0\x01"), "\x01")  # (B, 2n+1)
    position = tf.ragged.range(pieces.row_lengths())  # (B, 2n+1)
    placeholders = tf.ragged.boolean_mask(pieces, position % 2 == 1)  # (B, n)
    tf.debugging.assert_less_equal(placeholders.row_lengths(), tf.constant(MAX_PLACEHOLDERS, tf.int64),
                                   message="a text holds more placeholders than can be masked")
    flat_position = position.flat_values
    symbols = tf.strings.unicode_encode(tf.cast(flat_position // 2 + BASE, tf.int32)[:, None], "UTF-8")  # (N,)
    masked = tf.strings.reduce_join(
        pieces.with_flat_values(tf.where(flat_position % 2 == 1, symbols, pieces.flat_values)), axis=1)
    has_accelerator = tf.strings.regex_full_match(masked, "(?s).*?" + _ACCEL + ".*")
    accelerator = tf.where(has_accelerator, tf.strings.regex_replace(masked, "(?s)^.*?" + _ACCEL + ".*$", r"\2"), "")
    masked = tf.strings.regex_replace(masked, _ACCEL, r"\1\3", replace_global=False)
    return {
        "source": texts,
        "text": masked,
        "prefix": prefix,
        "suffix": suffix,
        "placeholders": placeholders,
        "accelerator": accelerator,
        "translatable": tf.strings.regex_full_match(masked, "(?s).*" + _TRANSLATABLE + ".*"),
    }


def restore_tf(masked, outputs):
    """`restore` in graph ops: `masked` from `mask_tf`, model `outputs` `(B,)` -> messages `(B,)`."""
    import tensorflow as tf

    placeholders = masked["placeholders"]
    counts = placeholders.row_lengths()  # (B,) int64
    outputs = tf.strings.regex_replace(tf.strings.regex_replace(outputs, _RAW, ""), _ACCEL, r"\1\3")
    outputs = tf.strings.regex_replace(outputs, _STRIP_RE2, "")
    core = _each_reserved_once_tf(outputs, counts)
    core = tf.strings.regex_replace(core, _STRIP_RE2, "")
    core = tf.where(tf.equal(core, ""), masked["text"], core)  # nothing left: the source text
    core = _accelerator_back_tf(core, masked["accelerator"])
    core = _placeholders_back_tf(core, placeholders, counts)
    restored = tf.strings.join([masked["prefix"], core, masked["suffix"]])
    return tf.where(masked["translatable"], restored, masked["source"])


def _each_reserved_once_tf(outputs, counts):
    """`outputs` `(B,)` with the first occurrence of each of a row's `counts` reserved characters kept, the others
    dropped, and the missing ones appended, each after a space."""
    import tensorflow as tf

    # Keep the first occurrence of each known reserved character.
    codes = tf.strings.unicode_decode(outputs, "UTF-8", errors="replace")  # (B, C) int32
    flat, rows = codes.flat_values, codes.value_rowids()
    index = tf.cast(flat - BASE, tf.int64)
    reserved = (flat >= BASE) & (flat < BASE + MAX_PLACEHOLDERS)
    valid = reserved & (index < tf.gather(counts, rows))
    valid_at = tf.boolean_mask(tf.range(tf.size(flat, out_type=tf.int64)), valid)
    unique, which = tf.unique(tf.boolean_mask(rows * MAX_PLACEHOLDERS + index, valid))
    first = tf.math.unsorted_segment_min(valid_at, which, tf.size(unique))  # flat positions of first occurrences
    is_first = tf.scatter_nd(first[:, None], tf.ones_like(first, tf.int32), tf.shape(flat, out_type=tf.int64)) > 0
    kept = tf.ragged.boolean_mask(codes, codes.with_flat_values(~reserved | is_first))

    # Append the missing ones, each after a space.
    width = tf.maximum(tf.reduce_max(tf.concat([counts, [0]], 0)), 1)
    present = tf.scatter_nd(tf.stack([tf.gather(rows, first), tf.gather(index, first)], axis=1),
                            tf.ones_like(first, tf.int32), tf.stack([tf.size(counts, out_type=tf.int64), width])) > 0
    every = tf.ragged.range(counts)  # (B, n)
    is_present = tf.gather_nd(present, tf.stack([every.value_rowids(), every.flat_values], axis=1))
    missing = tf.ragged.boolean_mask(every, every.with_flat_values(~is_present))  # (B, m)
    pairs = tf.stack([tf.fill(tf.shape(missing.flat_values), tf.constant(32, tf.int64)), missing.flat_values + BASE],
                     axis=1)  # (M, 2): a space, then the character
    appendix = tf.RaggedTensor.from_row_splits(tf.cast(tf.reshape(pairs, [-1]), tf.int32), missing.row_splits * 2)
    return tf.strings.unicode_encode(tf.concat([kept, appendix], axis=1), "UTF-8")  # (B,)


def _accelerator_back_tf(core, accelerator):
    """`core` `(B,)` with each row's accelerator mark (`accelerator`: "_", "&" or "") before its first letter, or at
    the start."""
    import tensorflow as tf

    has_letter = tf.strings.regex_full_match(core, f"(?s).*[{_LETTER}].*")
    for mark in ("_", "&"):
        placed = tf.where(has_letter,
                          tf.strings.regex_replace(core, f"^([^{_LETTER}]*)([{_LETTER}])", "\\1" + mark + "\\2",
                                                   replace_global=False),
                          tf.strings.join([mark, core]))
        core = tf.where(tf.equal(accelerator, mark), placed, core)
    return core


def _placeholders_back_tf(core, placeholders, counts):
    """`core` `(B,)` with reserved characters turned back into the row's `placeholders` (ragged `(B, n)`), and
    unnumbered printf conversions in source order."""
    import tensorflow as tf

    codes = tf.strings.unicode_decode(core, "UTF-8", errors="replace")  # (B, C)
    flat, rows = codes.flat_values, codes.value_rowids()
    reserved = (flat >= BASE) & (flat < BASE + MAX_PLACEHOLDERS)
    starts = tf.gather(placeholders.row_splits, rows)  # each character's row offset into placeholders.flat_values
    flat_placeholders = tf.concat([placeholders.flat_values, [""]], 0)  # a spare slot for non-reserved characters
    spare = tf.size(placeholders.flat_values, out_type=tf.int64)
    at = tf.where(reserved, starts + tf.cast(flat - BASE, tf.int64), spare)
    ordered = tf.strings.regex_full_match(flat_placeholders, _ORDERED) & tf.not_equal(flat_placeholders, "%%")
    is_ordered_char = tf.gather(ordered, at)
    # The k-th unnumbered conversion in a row's output gets the row's k-th unnumbered conversion of the source.
    running = tf.cumsum(tf.cast(is_ordered_char, tf.int64), exclusive=True)
    running = tf.concat([running, [tf.reduce_sum(tf.cast(is_ordered_char, tf.int64))]], 0)
    rank = running[: tf.size(flat)] - tf.gather(running, tf.gather(codes.row_splits, rows))
    ordered_ragged = placeholders.with_flat_values(ordered[:-1])
    ordered_index = tf.ragged.boolean_mask(tf.ragged.range(counts), ordered_ragged)  # (B, k) source indices
    ordered_flat = tf.concat([ordered_index.flat_values, [0]], 0)
    slot = tf.where(is_ordered_char, tf.gather(ordered_index.row_splits, rows) + rank,
                    tf.size(ordered_index.flat_values, out_type=tf.int64))
    at = tf.where(is_ordered_char, starts + tf.gather(ordered_flat, slot), at)
    characters = tf.strings.unicode_encode(flat[:, None], "UTF-8")  # (C_total,)
    pieces = tf.where(reserved, tf.gather(flat_placeholders, at), characters)
    return tf.strings.reduce_join(codes.with_flat_values(pieces), axis=1)


def mask_pair(source, target):
    """A training pair as the model should see it: `(mask(source).text, masked target)`.

    The target loses its leading/trailing whitespace and accelerator mark like the source; each of its placeholders
    gets the reserved character of the same placeholder in the source (the first not yet taken), and placeholders
    the source does not have are dropped (`restore` would drop them too).
    """
    masked_source, masked_target = mask(source), mask(target)
    free = {}
    for index, placeholder in enumerate(masked_source.placeholders):
        free.setdefault(placeholder, []).append(index)
    characters = []
    for char in masked_target.text:
        index = ord(char) - BASE
        if 0 <= index < MAX_PLACEHOLDERS:
            taken = free.get(masked_target.placeholders[index])
            if taken:
                characters.append(chr(BASE + taken.pop(0)))
            continue
        characters.append(char)
    return masked_source.text, "".join(characters)
