"""RapidJSON 1.1.0's `Writer::Double`, which TF Serving's error messages print doubles with: Grisu2's digits,
then `Prettify` (`1.0`, `0.001`, `1e21`, `1.5e-7`). python-rapidjson writes floats with Python's `repr`, whose
shortest digits are not always Grisu2's (`4.445845492335538e16` is `44458454923355379.0` here, as a C++ build of
1.1.0 prints it). Used by `rapidjson.PrettyWriter`; reading is python-rapidjson's alone.
"""

import math
import struct

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
