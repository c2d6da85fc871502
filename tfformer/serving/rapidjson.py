"""JSON the way TF Serving's REST API reads and writes it (TF Serving uses RapidJSON 1.1.0).

Reading: `parse(body)` parses with python-rapidjson, which wraps RapidJSON: its error messages and byte offsets
(`JSON Parse error: Invalid value. at offset: 0`), its split between integers (up to uint64) and doubles, its
double conversion, and the `NaN`/`Infinity` tokens (`NM_NATIVE | NM_NAN` is RapidJSON's own number parsing with
`kParseNanAndInfFlag`, TF Serving's flag). Objects come back as `JsonObject`, which keeps the first of duplicate
keys as RapidJSON's `FindMember` does. A leading UTF-8 byte order mark, or any leading part of one, is skipped and
counted in offsets, as TF Serving's input stream does. python-rapidjson's RapidJSON is newer than 1.1.0 and
stricter on a few malformed bodies that 1.1.0 reads on (bytes that are not UTF-8, a lone `\\udc00` escape,
`NaN.5`, `10e308`): those are refused here with TF Serving's status and error shape and python-rapidjson's message.

Writing: `PrettyWriter` reproduces RapidJSON's `PrettyWriter` layout (4-space indent, `kFormatSingleLineArray`),
`format_decimal` TF Serving's float printing (`WriteDecimal`: shortest of `%g` that round-trips, else 9/17
digits, `.0` on whole numbers, bare `NaN`/`Infinity`), and `value_to_string` TF Serving's `JsonValueToString`
used inside error messages, with doubles as 1.1.0's `Writer::Double` prints them (`grisu2.write_double`). No
library writes these layouts.
"""

import math
import re

import numpy as np
import rapidjson

from tfformer.serving.grisu2 import write_double
from tfformer.serving.status import invalid_argument

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


def to_bytes(text):
    """A JSON string back to its bytes (UTF-8: python-rapidjson refuses bodies that are not)."""
    return text.encode("utf-8")


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


class _Decoder(rapidjson.Decoder):
    """Objects arrive as member lists, so `JsonObject` sees duplicate keys."""

    def start_object(self):
        return []

    def end_object(self, members):
        return JsonObject(members)


_decode = _Decoder(number_mode=rapidjson.NM_NATIVE | rapidjson.NM_NAN)
_ERROR = re.compile(r"Parse error at offset (\d+): (.*)", re.S)


def parse(body):
    """Parses a request body (bytes) like TF Serving's `ParseJson`.

    Raises:
        ServingError: INVALID_ARGUMENT `JSON Parse error: <RapidJSON message> at offset: N`.
    """
    if not body:
        raise invalid_argument("JSON Parse error: The document is empty")
    body, start = bytes(body), 0
    for byte in b"\xef\xbb\xbf":  # EncodedInputStream<UTF8<>, MemoryStream> skips each BOM byte in turn
        if body[start:start + 1] == bytes((byte,)):
            start += 1
    try:
        return _decode(body[start:] if start else body)
    except rapidjson.JSONDecodeError as error:
        offset, message = _ERROR.match(str(error)).groups()
    except UnicodeDecodeError as error:  # python-rapidjson decodes the whole body first
        offset, message = error.start, f"Invalid encoding: byte 0x{body[start + error.start]:02x} is not UTF-8."
    except RecursionError as error:  # deeper than Python's limit: the handler refuses, as a RapidJSON handler can
        match = _ERROR.match(str(error))
        offset, message = (match.group(1) if match else 0), "Terminate parsing due to Handler error."
    raise invalid_argument(f"JSON Parse error: {message} at offset: {int(offset) + start}") from None


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
            self.raw(write_double(value))
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
