"""The run directory: what a training run writes, and the rule that nothing is overwritten silently."""

import json
import os
import shutil

FINISHED_MARKER = "metrics.json"


def prepare(path, overwrite=False):
    """Create `path` for a new run, or return 'resume' for an interrupted one.

    A finished run (it has metrics.json) or a folder with unrelated files is
    never touched unless `overwrite` is set; an interrupted run (it has a
    backup/ and no metrics.json) is resumed.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"Run directory {path!r} exists and is a file.")
    if os.path.isdir(path) and os.listdir(path):
        if overwrite:
            shutil.rmtree(path)
        elif os.path.isdir(os.path.join(path, "backup")) and not os.path.exists(os.path.join(path, FINISHED_MARKER)):
            return "resume"
        else:
            raise ValueError(f"Run directory {path!r} already holds a run; pass --overwrite to replace it, or choose --out.")
    os.makedirs(path, exist_ok=True)
    return "new"


def write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True, ensure_ascii=False)
    os.replace(tmp, path)


def read_json(path):
    with open(path) as handle:
        return json.load(handle)
