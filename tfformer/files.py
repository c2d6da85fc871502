"""Files written whole or not at all; this module imports nothing from tfformer.

A file is written under a temporary name beside it, then `os.replace` swaps it in: a reader never sees half a file.
A write that fails leaves the old file (or none) and removes its temporary; a killed process leaves the old file and a
stray `.tmp-<pid>-<name>`.
"""

import contextlib
import json
import os


@contextlib.contextmanager
def atomic_path(path):
    """A temporary path to write instead of `path` (same directory and extension), moved onto `path` when the block
    ends without an error; removed when the block or the move fails (`path` is then as it was)."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".tmp-{os.getpid()}-{name}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_atomic(path, content):
    """Write `content` (bytes, or a str as UTF-8) to `path` atomically (`atomic_path`); returns `path`."""
    with atomic_path(path) as tmp:
        with (open(tmp, "w", encoding="utf-8", newline="") if isinstance(content, str) else open(tmp, "wb")) as f:
            f.write(content)
    return path


def write_json(path, data):
    """`data` as indented JSON, keys sorted, non-ASCII kept, written atomically (`write_atomic`)."""
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False))
