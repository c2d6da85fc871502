"""What the catalog tests share: GNU msgfmt's verdict on a .po file, and a message's edge whitespace."""

import os
import shutil
import subprocess

import pytest

WS = " \t\n\r\f\v"


def msgfmt(path, *flags):
    """`msgfmt --check-format [flags] -o /dev/null path` (skips the test where gettext is not installed)."""
    if shutil.which("msgfmt") is None:
        pytest.skip("GNU gettext's msgfmt is not installed (Debian package `gettext`)")
    return subprocess.run(["msgfmt", "--check-format", *flags, "-o", os.devnull, path], capture_output=True, text=True)


def edge_whitespace(text):
    """The leading and trailing whitespace of `text`."""
    return text[: len(text) - len(text.lstrip(WS))], text[len(text.rstrip(WS)):]
