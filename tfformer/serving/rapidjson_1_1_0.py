"""Ports of RapidJSON 1.1.0, the version TF Serving pins, for what python-rapidjson cannot stand in for.

`Reader` is 1.1.0's recursive reader with kParseNanAndInfFlag; `rapidjson.parse` hands it the bodies that the
newer RapidJSON inside python-rapidjson reads differently. `write_double` is 1.1.0's `Writer::Double` (Grisu2
digits, then `Prettify`); python-rapidjson writes floats with Python's `repr`, whose digits are not always
Grisu2's. The expected values in tests/serving come from 1.1.0 running TF Serving's `ParseJson` and
`PrettyWriter`.
"""

import math
import re
import struct


class ParseError(Exception):
    """RapidJSON's parse error: `GetParseError_En` text and byte offset."""

    def __init__(self, message, offset):
        super().__init__(message, offset)
        self.message, self.offset = message, offset


# --------------------------------------------------------------------------------------------
# Reading

_ESCAPES = {ord('"'): b'"', ord("\\"): b"\\", ord("/"): b"/", ord("b"): b"\b", ord("f"): b"\f",
            ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t"}
_WHITESPACE = b" \t\n\r"
_HEX = b"0123456789abcdefABCDEF"
_PLAIN = re.compile(rb'[^"\\\x00-\x1f]+')  # string bytes copied as they are
_POW10 = [float(f"1e{k}") for k in range(309)]  # RapidJSON's Pow10 table


def _fast_path(significand, exp):
    if exp < -308:
        return 0.0
    return significand * _POW10[exp] if exp >= 0 else significand / _POW10[-exp]


def _strtod_normal_precision(significand, exp):
    """RapidJSON's `StrtodNormalPrecision`, the double conversion without kParseFullPrecisionFlag."""
    if exp < -308:
        return _fast_path(_fast_path(significand, -308), exp + 308)
    return _fast_path(significand, exp)


class Reader:
    """RapidJSON 1.1.0's recursive `GenericReader` with kParseNanAndInfFlag: same values, errors and offsets."""

    def __init__(self, data, make_object):
        self.data, self.make_object = data, make_object
        self.pos = 0
        for byte in b"\xef\xbb\xbf":  # EncodedInputStream<UTF8<>, MemoryStream> skips each BOM byte in turn
            if self.peek() == byte:
                self.pos += 1

    def peek(self):
        # A memory stream returns '\0' at its end, and RapidJSON treats a NUL byte the same way.
        return self.data[self.pos] if self.pos < len(self.data) else 0

    def consume(self, char):
        if self.peek() == char:
            self.pos += 1
            return True
        return False

    def digit(self):
        char = self.peek()
        return char - 48 if 48 <= char <= 57 else None

    def skip_whitespace(self):
        while self.peek() and self.peek() in _WHITESPACE:
            self.pos += 1

    def error(self, message, offset=None):
        raise ParseError(message, self.pos if offset is None else offset)

    def parse(self):
        """The document's value, or `ParseError`."""
        try:
            self.skip_whitespace()
            if self.peek() == 0:
                self.error("The document is empty.")
            value = self.value()
            self.skip_whitespace()
            if self.peek() != 0:
                self.error("The document root must not be followed by other values.")
            return value
        except RecursionError:  # deeper than Python's limit: the handler refuses, as a RapidJSON handler can
            raise ParseError("Terminate parsing due to Handler error.", self.pos) from None

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
        codepoint = 0
        for _ in range(4):
            char = self.peek()
            if char not in _HEX:
                self.error("Incorrect hex digit after \\u escape in string.", escape_offset)
            codepoint = codepoint * 16 + int(chr(char), 16)
            self.pos += 1
        return codepoint

    def string(self):
        self.pos += 1
        out = bytearray()
        while True:
            char = self.peek()
            if char == ord("\\"):
                escape_offset = self.pos
                self.pos += 1
                escaped = self.peek()
                if escaped in _ESCAPES:
                    self.pos += 1
                    out += _ESCAPES[escaped]
                elif escaped == ord("u"):
                    self.pos += 1
                    codepoint = self.hex4(escape_offset)
                    if 0xD800 <= codepoint <= 0xDBFF:  # a lone low surrogate is encoded as it is
                        if not (self.consume(ord("\\")) and self.consume(ord("u"))):
                            self.error("The surrogate pair in string is invalid.", escape_offset)
                        low = self.hex4(escape_offset)
                        if not 0xDC00 <= low <= 0xDFFF:
                            self.error("The surrogate pair in string is invalid.", escape_offset)
                        codepoint = (((codepoint - 0xD800) << 10) | (low - 0xDC00)) + 0x10000
                    out += chr(codepoint).encode("utf-8", "surrogatepass")
                else:
                    self.error("Invalid escape character in string.", escape_offset)
            elif char == ord('"'):
                self.pos += 1
                return out.decode("utf-8", "surrogateescape")
            elif char < 0x20:
                self.error("Missing a closing quotation mark in string." if char == 0
                           else "Invalid escape character in string.")
            else:
                end = _PLAIN.match(self.data, self.pos).end()
                out += self.data[self.pos:end]
                self.pos = end

    def object(self):
        self.pos += 1
        self.skip_whitespace()
        members = []
        if self.consume(ord("}")):
            return self.make_object(members)
        while True:
            if self.peek() != ord('"'):
                self.error("Missing a name for object member.")
            key = self.string()
            self.skip_whitespace()
            if not self.consume(ord(":")):
                self.error("Missing a colon after a name of object member.")
            self.skip_whitespace()
            members.append((key, self.value()))
            self.skip_whitespace()
            if self.consume(ord(",")):
                self.skip_whitespace()
            elif self.consume(ord("}")):
                return self.make_object(members)
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
        """`ParseNumber` of 1.1.0, step by step, including where it checks for overflow."""
        start = self.pos
        minus = self.consume(ord("-"))
        integer, significand_digits, use_double, nan_inf, d = 0, 0, False, False, 0.0
        limit = 2**63 if minus else 2**64 - 1
        if self.peek() == ord("0"):
            self.pos += 1
        elif self.digit() is not None:
            integer = self.digit()
            self.pos += 1
            while (digit := self.digit()) is not None:
                if integer * 10 + digit > limit:  # past (u)int64: continue as a double
                    d, use_double = float(integer), True
                    break
                integer = integer * 10 + digit
                significand_digits += 1
                self.pos += 1
            while use_double and (digit := self.digit()) is not None:
                if d >= 1.7976931348623157e307:  # DBL_MAX / 10
                    self.error("Number too big to be stored in double.", start)
                d = d * 10 + digit
                self.pos += 1
        elif self.peek() in (ord("N"), ord("I")):
            nan_inf = True
            if self.consume(ord("N")) and self.consume(ord("a")) and self.consume(ord("N")):
                d = math.nan
            elif self.consume(ord("I")) and self.consume(ord("n")) and self.consume(ord("f")):
                d = -math.inf if minus else math.inf
                if self.peek() == ord("i") and not all(self.consume(char) for char in b"inity"):
                    self.error("Invalid value.")
            else:
                self.error("Invalid value.")
        else:
            self.error("Invalid value.")
        exp_frac = 0
        if self.consume(ord(".")):
            if self.digit() is None:
                self.error("Miss fraction part in number.")
            if not use_double:
                while (digit := self.digit()) is not None and integer <= 2**53 - 1:
                    integer = integer * 10 + digit
                    exp_frac -= 1
                    significand_digits += integer != 0
                    self.pos += 1
                d, use_double = float(integer), True
            while (digit := self.digit()) is not None:
                if significand_digits < 17:
                    d = d * 10 + digit
                    exp_frac -= 1
                    significand_digits += d > 0
                self.pos += 1
        exp = 0
        if self.consume(ord("e")) or self.consume(ord("E")):
            if not use_double:
                d, use_double = float(integer), True
            exp_minus = not self.consume(ord("+")) and self.consume(ord("-"))
            if self.digit() is None:
                self.error("Miss exponent in number.")
            while (digit := self.digit()) is not None:
                self.pos += 1
                if exp < 214748364:  # past it 1.1.0 only consumes the digits
                    exp = exp * 10 + digit
                if not exp_minus and exp > 308 - exp_frac:
                    self.error("Number too big to be stored in double.", start)
            exp = -exp if exp_minus else exp
        if use_double:
            d = _strtod_normal_precision(d, exp + exp_frac)
            return -d if minus else d
        if nan_inf:
            return d
        return -integer if minus else integer



# --------------------------------------------------------------------------------------------
# Writing

_M64 = 2**64 - 1


def _cached_power(k):
    """10^k as a 64-bit normalized significand (rounded to nearest) and binary exponent: Grisu's cached powers."""
    num, den = (10**k, 1) if k >= 0 else (1, 10**-k)
    e = num.bit_length() - den.bit_length() - 64
    while True:  # (num / den) / 2^e in [2^63, 2^64)
        f = (num << -e) // den if e < 0 else num // (den << e)
        if f >= 2**64:
            e += 1
        elif f < 2**63:
            e -= 1
        else:
            break
    scaled_num, scaled_den = (num << -e, den) if e < 0 else (num, den << e)
    f, rest = divmod(scaled_num, scaled_den)
    return (f + (2 * rest >= scaled_den), e) if f + 1 < 2**64 else (f, e)


_CACHED_POWERS = [_cached_power(-348 + 8 * i) for i in range(87)]


def _multiply(x, y):
    """DiyFp's `operator*`: the high 64 bits of the product, rounded."""
    product = x[0] * y[0]
    return ((product >> 64) + ((product >> 63) & 1), x[1] + y[1] + 64)


def _grisu_round(digits, delta, rest, ten_kappa, wp_w):
    while (rest < wp_w and delta - rest >= ten_kappa
           and (rest + ten_kappa < wp_w or wp_w - rest > rest + ten_kappa - wp_w)):
        digits[-1] -= 1
        rest += ten_kappa


def _grisu2(value):
    """`Grisu2` (with `DigitGen`) on a positive double: (digits, K) with value ~= int(digits) * 10**K."""
    bits = struct.unpack("<Q", struct.pack("<d", value))[0]
    biased_e, significand = bits >> 52, bits & (2**52 - 1)
    f, e = (significand + 2**52, biased_e - 1075) if biased_e else (significand, -1074)
    plus_f, plus_e = (f << 1) + 1, e - 1  # NormalizedBoundaries
    while not plus_f & 2**53:
        plus_f, plus_e = plus_f << 1, plus_e - 1
    plus_f, plus_e = plus_f << 10, plus_e - 10
    minus_f, minus_e = ((f << 2) - 1, e - 2) if f == 2**52 else ((f << 1) - 1, e - 1)
    minus_f <<= minus_e - plus_e
    dk = (-61 - plus_e) * 0.30102999566398114 + 347  # GetCachedPower
    index = ((int(dk) + (dk - int(dk) > 0.0)) >> 3) + 1
    K = 348 - 8 * index
    cached = _CACHED_POWERS[index]
    shift = 64 - f.bit_length()
    w_f = _multiply((f << shift, e - shift), cached)[0]
    mp_f, one_e = _multiply((plus_f, plus_e), cached)
    mp_f -= 1
    delta = mp_f - (_multiply((minus_f, plus_e), cached)[0] + 1)
    one_f, wp_w = 1 << -one_e, mp_f - w_f
    p1, p2 = mp_f >> -one_e, mp_f & ((1 << -one_e) - 1)
    kappa = min(len(str(p1)), 9)  # CountDecimalDigit32
    digits = []
    while kappa > 0:
        digit, p1 = divmod(p1, 10 ** (kappa - 1))
        if digit or digits:
            digits.append(digit)
        kappa -= 1
        rest = (p1 << -one_e) + p2
        if rest <= delta:
            _grisu_round(digits, delta, rest, (10**kappa) << -one_e, wp_w)
            return "".join(chr(48 + digit) for digit in digits), K + kappa
    while True:
        p2, delta = p2 * 10, delta * 10
        digit, p2 = p2 >> -one_e, p2 & (one_f - 1)
        if digit or digits:
            digits.append(digit)
        kappa -= 1
        if p2 < delta:
            _grisu_round(digits, delta, p2, one_f, (wp_w * (10**-kappa if -kappa < 9 else 0)) & _M64)
            return "".join(chr(48 + digit) for digit in digits), K + kappa


def write_double(value):
    """`Writer::Double`: `1.0`, `0.001`, `1e21`, `1.5e-7`, `-0.0` (callers handle NaN and Infinity)."""
    if value == 0:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
    sign = "-" if value < 0 else ""
    digits, k = _grisu2(abs(value))
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
