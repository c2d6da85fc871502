"""JSON the way TF Serving's REST API reads and writes it (it uses RapidJSON).

Reading: `parse(body)` returns plain Python values (`JsonObject` for objects),
accepting what RapidJSON accepts with `kParseNanAndInfFlag` (the `NaN`,
`Infinity`, `-Infinity`, `Inf` tokens; raw non-UTF-8 bytes inside strings) and
failing with RapidJSON's own error message and byte offset
(`JSON Parse error: Invalid value. at offset: 0`). The fast path is the
standard library's C parser; documents it rejects, and the few it accepts but
RapidJSON does not, are re-read by a small RapidJSON-compatible parser.

Strings are decoded from UTF-8 with `surrogateescape`, so the original bytes
come back with `to_bytes`. Integers keep RapidJSON's split between integers
(up to uint64) and doubles (anything with a `.`/exponent, or too large).

Writing: `PrettyWriter` reproduces RapidJSON's `PrettyWriter` layout (4-space
indent, `kFormatSingleLineArray`), `format_decimal` TF Serving's float printing
(`WriteDecimal`: shortest of `%g` that round-trips, else 9/17 digits, `.0` on
whole numbers, bare `NaN`/`Infinity`), and `value_to_string` TF Serving's
`JsonValueToString` used inside error messages.
"""

import json
import math
import re

import numpy as np

from tfformer.serving.status import invalid_argument

_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
_FLOAT32_MAX = 3.4028234e38  # RapidJSON's IsFloat() range check


class JsonObject(dict):
    """A JSON object. Keeps the first of duplicate keys (RapidJSON's FindMember) and counts members."""

    __slots__ = ("member_count",)

    def __init__(self, pairs=()):
        super().__init__()
        count = 0
        for key, value in pairs:
            count += 1
            if key not in self:
                self[key] = value
        self.member_count = count


class JsonParseError(Exception):
    def __init__(self, message, offset):
        super().__init__(message)
        self.message, self.offset = message, offset


def to_bytes(text):
    """A JSON string (decoded with surrogateescape) back to its original bytes."""
    return text.encode("utf-8", "surrogateescape")


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def type_string(value):
    """RapidJSON type names used in TF Serving messages."""
    if value is None:
        return "Null"
    if value is True:
        return "True"
    if value is False:
        return "False"
    if isinstance(value, dict):
        return "Object"
    if isinstance(value, list):
        return "Array"
    if isinstance(value, str):
        return "String"
    return "Number"


# --------------------------------------------------------------------------------------------
# Reading


class _Overflow(Exception):
    pass


def _parse_int(text):
    value = int(text)
    if _INT64_MIN <= value <= _UINT64_MAX:
        return value
    return float(value)  # RapidJSON stores integers beyond (u)int64 as doubles


def _parse_float(text):
    value = float(text)
    if math.isinf(value):
        raise _Overflow(text)
    return value


_CONSTANTS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# Inputs the C parser accepts but RapidJSON does not (surrogate escapes need pair checks).
_NEEDS_SLOW_PATH = re.compile(rb"\\u[dD][89a-fA-F]|\x00")


def parse(body):
    """Parses a request body (bytes) like TF Serving's `ParseJson`.

    Raises:
        ServingError: INVALID_ARGUMENT `JSON Parse error: <RapidJSON message> at offset: N`.
    """
    if not body:
        raise invalid_argument("JSON Parse error: The document is empty")
    if not _NEEDS_SLOW_PATH.search(body):
        try:
            text = body.decode("utf-8", "surrogateescape")
            return json.loads(
                text,
                object_pairs_hook=JsonObject,
                parse_int=_parse_int,
                parse_float=_parse_float,
                parse_constant=_CONSTANTS.__getitem__,
            )
        except (ValueError, _Overflow, RecursionError):
            pass
    try:
        return _Reader(body).parse()
    except JsonParseError as error:
        raise invalid_argument(f"JSON Parse error: {error.message} at offset: {error.offset}") from None
    except RecursionError:
        raise invalid_argument("JSON Parse error: Terminate parsing due to Handler error. at offset: 0") from None


_ESCAPES = {ord('"'): '"', ord("\\"): "\\", ord("/"): "/", ord("b"): "\b", ord("f"): "\f",
            ord("n"): "\n", ord("r"): "\r", ord("t"): "\t"}
_WHITESPACE = b" \t\n\r"
_HEX = b"0123456789abcdefABCDEF"


class _Reader:
    """RapidJSON's GenericReader (recursive, kParseNanAndInfFlag), errors with the same offsets."""

    def __init__(self, data):
        self.data = bytes(data)
        self.pos = 3 if self.data.startswith(b"\xef\xbb\xbf") else 0  # EncodedInputStream skips a UTF-8 BOM

    def peek(self):
        # A memory stream returns '\0' at its end, and RapidJSON treats a NUL byte the same way.
        return self.data[self.pos] if self.pos < len(self.data) else 0

    def consume(self, char):
        if self.peek() == char:
            self.pos += 1
            return True
        return False

    def skip_whitespace(self):
        data, pos = self.data, self.pos
        while pos < len(data) and data[pos] in _WHITESPACE:
            pos += 1
        self.pos = pos

    def error(self, message, offset=None):
        raise JsonParseError(message, self.pos if offset is None else offset)

    def parse(self):
        self.skip_whitespace()
        if self.peek() == 0:
            self.error("The document is empty.")
        value = self.value()
        self.skip_whitespace()
        if self.peek() != 0:
            self.error("The document root must not be followed by other values.")
        return value

    def value(self):
        char = self.peek()
        if char == ord("n"):
            return self.literal(b"null", None)
        if char == ord("t"):
            return self.literal(b"true", True)
        if char == ord("f"):
            return self.literal(b"false", False)
        if char == ord('"'):
            return self.string()
        if char == ord("{"):
            return self.object()
        if char == ord("["):
            return self.array()
        return self.number()

    def literal(self, word, value):
        self.pos += 1
        for char in word[1:]:
            if not self.consume(char):
                self.error("Invalid value.")
        return value

    def hex4(self, escape_offset):
        digits = self.data[self.pos:self.pos + 4]
        for i, char in enumerate(digits):
            if char not in _HEX:
                self.pos += i
                self.error("Incorrect hex digit after \\u escape in string.", escape_offset)
        if len(digits) < 4:
            self.pos += len(digits)
            self.error("Incorrect hex digit after \\u escape in string.", escape_offset)
        self.pos += 4
        return int(digits, 16)

    def string(self):
        self.pos += 1
        out = bytearray()
        data = self.data
        while True:
            char = self.peek()
            if char == ord("\\"):
                escape_offset = self.pos
                self.pos += 1
                escaped = self.peek()
                if escaped in _ESCAPES:
                    self.pos += 1
                    out += _ESCAPES[escaped].encode()
                elif escaped == ord("u"):
                    self.pos += 1
                    codepoint = self.hex4(escape_offset)
                    if 0xD800 <= codepoint <= 0xDFFF:
                        if codepoint > 0xDBFF:
                            self.error("The surrogate pair in string is invalid.", escape_offset)
                        if not (self.consume(ord("\\")) and self.consume(ord("u"))):
                            self.error("The surrogate pair in string is invalid.", escape_offset)
                        low = self.hex4(escape_offset)
                        if not 0xDC00 <= low <= 0xDFFF:
                            self.error("The surrogate pair in string is invalid.", escape_offset)
                        codepoint = (((codepoint - 0xD800) << 10) | (low - 0xDC00)) + 0x10000
                    out += chr(codepoint).encode("utf-8")
                else:
                    self.error("Invalid escape character in string.", escape_offset)
            elif char == ord('"'):
                self.pos += 1
                return out.decode("utf-8", "surrogateescape")
            elif char < 0x20:
                self.error("Missing a closing quotation mark in string." if char == 0
                           else "Invalid encoding in string.")
            else:
                # Copy a run of plain bytes at once.
                end = self.pos + 1
                while end < len(data) and data[end] >= 0x20 and data[end] not in (0x22, 0x5C):
                    end += 1
                out += data[self.pos:end]
                self.pos = end

    def object(self):
        self.pos += 1
        self.skip_whitespace()
        pairs = []
        if self.consume(ord("}")):
            return JsonObject(pairs)
        while True:
            if self.peek() != ord('"'):
                self.error("Missing a name for object member.")
            key = self.string()
            self.skip_whitespace()
            if not self.consume(ord(":")):
                self.error("Missing a colon after a name of object member.")
            self.skip_whitespace()
            pairs.append((key, self.value()))
            self.skip_whitespace()
            if self.consume(ord(",")):
                self.skip_whitespace()
            elif self.consume(ord("}")):
                return JsonObject(pairs)
            else:
                self.error("Missing a comma or '}' after an object member.")

    def array(self):
        self.pos += 1
        self.skip_whitespace()
        values = []
        if self.consume(ord("]")):
            return values
        while True:
            values.append(self.value())
            self.skip_whitespace()
            if self.consume(ord(",")):
                self.skip_whitespace()
            elif self.consume(ord("]")):
                return values
            else:
                self.error("Missing a comma or ']' after an array element.")

    def number(self):
        start = self.pos
        minus = self.consume(ord("-"))
        char = self.peek()
        if char == ord("0"):
            self.pos += 1
        elif ord("1") <= char <= ord("9"):
            while ord("0") <= self.peek() <= ord("9"):
                self.pos += 1
        elif char in (ord("N"), ord("I")):
            if self.consume(ord("N")):
                if self.consume(ord("a")) and self.consume(ord("N")):
                    return math.nan
            elif self.consume(ord("I")):
                if self.consume(ord("n")) and self.consume(ord("f")):
                    if self.peek() == ord("i") and not all(self.consume(ord(c)) for c in "inity"):
                        self.error("Invalid value.")
                    return -math.inf if minus else math.inf
            self.error("Invalid value.")
        else:
            self.error("Invalid value.")
        is_double = False
        if self.consume(ord(".")):
            is_double = True
            if not ord("0") <= self.peek() <= ord("9"):
                self.error("Miss fraction part in number.")
            while ord("0") <= self.peek() <= ord("9"):
                self.pos += 1
        if self.consume(ord("e")) or self.consume(ord("E")):
            is_double = True
            if not self.consume(ord("+")):
                self.consume(ord("-"))
            if not ord("0") <= self.peek() <= ord("9"):
                self.error("Miss exponent in number.")
            while ord("0") <= self.peek() <= ord("9"):
                self.pos += 1
        text = self.data[start:self.pos].decode("ascii")
        if not is_double:
            return _parse_int(text)
        value = float(text)
        if math.isinf(value):
            self.error("Number too big to be stored in double.", start)
        return value


# --------------------------------------------------------------------------------------------
# Writing


def format_decimal(value, single):
    """TF Serving's `WriteDecimal`: `3.0`, `0.1`, `1e-05`, `0.333333343`, `NaN`, `-Infinity`."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "-Infinity" if value < 0 else "Infinity"
    if single:
        value = np.float32(value)
        text = "%g" % value
        if np.float32(float(text)) != value:
            text = "%.9g" % value
    else:
        value = float(value)
        text = "%g" % value
        if float(text) != value:
            text = "%.17g" % value
    if "." not in text and "e" not in text:
        text += ".0"
    return text


def _grisu(value):
    """RapidJSON `Writer::Double` (Grisu2 shortest digits + `Prettify`): 1.0, 1e21, 1.5e-7, 0.001."""
    if value == 0:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
    sign = "-" if value < 0 else ""
    mantissa, _, exponent = repr(abs(value)).partition("e")  # shortest round-trip digits, like Grisu2
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0")
    k = (int(exponent) if exponent else 0) - len(fraction)  # value = int(digits) * 10**k
    stripped = digits.rstrip("0")
    k += len(digits) - len(stripped)
    digits = stripped
    length = len(digits)
    kk = length + k
    if 0 <= k and kk <= 21:
        return sign + digits + "0" * k + ".0"
    if 0 < kk <= 21:
        return sign + digits[:kk] + "." + digits[kk:]
    if -6 < kk <= 0:
        return sign + "0." + "0" * (-kk) + digits
    if length == 1:
        return f"{sign}{digits}e{kk - 1}"
    return f"{sign}{digits[0]}.{digits[1:]}e{kk - 1}"


def escape_string(text):
    """RapidJSON `Writer::String` escaping (control characters as `\\u00XX`, non-ASCII raw)."""
    out = ['"']
    for char in text:
        code = ord(char)
        if char == '"':
            out.append('\\"')
        elif char == "\\":
            out.append("\\\\")
        elif code < 0x20:
            out.append({8: "\\b", 9: "\\t", 10: "\\n", 12: "\\f", 13: "\\r"}.get(code, "\\u%04X" % code))
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


class _Abort(Exception):
    pass


class PrettyWriter:
    """RapidJSON's `PrettyWriter` (4-space indent), including `kFormatSingleLineArray`."""

    def __init__(self):
        self.out = []
        self.levels = []  # [in_array, value_count]
        self.single_line_array = False

    def _indent(self):
        self.out.append(" " * (4 * len(self.levels)))

    def _prefix(self):
        if not self.levels:
            return
        level = self.levels[-1]
        if level[0]:
            if level[1] > 0:
                self.out.append(", " if self.single_line_array else ",")
            if not self.single_line_array:
                self.out.append("\n")
                self._indent()
        else:
            if level[1] > 0:
                self.out.append(",\n" if level[1] % 2 == 0 else ": ")
            else:
                self.out.append("\n")
            if level[1] % 2 == 0:
                self._indent()
        level[1] += 1

    def raw(self, text):
        self._prefix()
        self.out.append(text)

    def string(self, text):
        self.raw(escape_string(text))

    key = string

    def start_object(self):
        self._prefix()
        self.out.append("{")
        self.levels.append([False, 0])

    def end_object(self):
        empty = self.levels.pop()[1] == 0
        if not empty:
            self.out.append("\n")
            self._indent()
        self.out.append("}")

    def start_array(self):
        self._prefix()
        self.out.append("[")
        self.levels.append([True, 0])

    def end_array(self):
        empty = self.levels.pop()[1] == 0
        if not empty and not self.single_line_array:
            self.out.append("\n")
            self._indent()
        self.out.append("]")

    def value(self, value):
        """Writes a parsed JSON value the way `GenericValue::Accept` does."""
        if value is None:
            self.raw("null")
        elif value is True or value is False:
            self.raw("true" if value else "false")
        elif isinstance(value, int):
            self.raw(str(value))
        elif isinstance(value, float):
            if math.isnan(value) or math.isinf(value):
                self._prefix()
                raise _Abort()  # Writer::Double refuses NaN/Inf without kWriteNanAndInfFlag
            self.raw(_grisu(value))
        elif isinstance(value, str):
            self.string(value)
        elif isinstance(value, dict):
            self.start_object()
            for key, item in value.items():
                self.key(key)
                self.value(item)
            self.end_object()
        else:
            self.start_array()
            for item in value:
                self.value(item)
            self.end_array()

    def getvalue(self):
        return "".join(self.out)


def value_to_string(value):
    """TF Serving's `JsonValueToString`, used in error messages (pretty-printed)."""
    if isinstance(value, float):
        in_float_range = -_FLOAT32_MAX <= value <= _FLOAT32_MAX  # RapidJSON IsFloat()
        return format_decimal(value, single=in_float_range)
    writer = PrettyWriter()
    try:
        writer.value(value)
    except _Abort:
        pass  # RapidJSON stops writing at the first NaN/Inf inside a container
    return writer.getvalue()


def error_body(message):
    """`{"error": ...}` as TF Serving's `MakeJsonFromStatus` writes it."""
    writer = PrettyWriter()
    writer.start_object()
    writer.key("error")
    writer.string(message)
    writer.end_object()
    return writer.getvalue()
