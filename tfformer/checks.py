"""Argument checks for every tfformer package; this module imports nothing from tfformer.

To Python a bool is an int (`isinstance(True, int)`); to tfformer it is never a count, a size, an id or a rate, so
every check here rejects it. A failed check raises a ValueError that names the argument, says what was expected
and shows what was received: "`beam_size` must be a positive integer. Received: beam_size=0".
"""

import numpy as np


def is_int(value, numpy=False):
    """Whether `value` is an int and not a bool; with `numpy`, NumPy integers count too."""
    return isinstance(value, (int, np.integer) if numpy else int) and not isinstance(value, bool)


def is_number(value):
    """Whether `value` is an int or a float and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name, value, minimum=1, maximum=None, allow_none=False, numpy=False, expected=None):
    """Raise a ValueError naming `name` unless `value` is an int in [minimum, maximum] (a None bound: no bound).

    `allow_none`: None passes too. `numpy`: NumPy integers pass too. The message says `expected`, by default
    "a positive integer" (minimum 1), "a non-negative integer" (minimum 0), "an integer >= m" or "an integer in
    [m, M]", then " or None" with `allow_none`.
    """
    if value is None and allow_none:
        return
    if (not is_int(value, numpy) or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        _fail(name, value, expected or _int_range(minimum, maximum), allow_none)


def check_number(name, value, above=None, at_least=None, below=None, at_most=None, allow_none=False, expected=None):
    """Raise a ValueError naming `name` unless `value` is an int or a float within the bounds given.

    `above`/`at_least` bound it from below (`>`/`>=`), `below`/`at_most` from above (`<`/`<=`). `allow_none`: None
    passes too. The message says `expected`, by default "a number" and its bounds ("a number > 0"), then " or None"
    with `allow_none`.
    """
    if value is None and allow_none:
        return
    if (not is_number(value) or (above is not None and not value > above)
            or (at_least is not None and not value >= at_least)
            or (below is not None and not value < below) or (at_most is not None and not value <= at_most)):
        bounds = [f"{sign} {bound}" for sign, bound in ((">", above), (">=", at_least), ("<", below), ("<=", at_most))
                  if bound is not None]
        _fail(name, value, expected or " ".join(["a number", " and ".join(bounds)]).strip(), allow_none)


def check_one_of(name, value, allowed):
    """Raise a ValueError naming `name` unless `value` is in `allowed` (a tuple, which the message lists)."""
    if value not in allowed:
        _fail(name, value, f"one of {allowed}", False)


def check_messages(messages):
    """`messages` must be a non-empty list of `{"role": str, "content": str}` dicts."""
    if isinstance(messages, (str, dict)) or not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError('`messages` must be a non-empty list of {"role": ..., "content": ...} dicts. '
                         f"Received: messages={messages!r:.120}")
    for i, message in enumerate(messages):
        if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)):
            raise ValueError(f'`messages[{i}]` must be a dict with str "role" and "content". Received: '
                             f"{message!r:.120}")


def _int_range(minimum, maximum):
    if maximum is not None:
        return f"an integer <= {maximum}" if minimum is None else f"an integer in [{minimum}, {maximum}]"
    if minimum is None:
        return "an integer"
    return {1: "a positive integer", 0: "a non-negative integer"}.get(minimum, f"an integer >= {minimum}")


def _fail(name, value, expected, allow_none):
    raise ValueError(f"`{name}` must be {expected}{' or None' if allow_none else ''}. Received: {name}={value!r}")
