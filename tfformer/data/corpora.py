"""Text corpora that exist offline: gettext catalogs, TSV files, plain text."""

import glob
import hashlib
import os
import pathlib
import struct
import sys

import polib

DEFAULT_LOCALE_DIR = "/usr/share/locale"
# Fractions of the stable hash space: 2% test, 2% validation, the rest training.
SPLITS = (("test", 2), ("validation", 4), ("train", 100))


def split_of(source):
    """'train', 'validation' or 'test' from a stable hash of the source text (same on every machine)."""
    bucket = int(hashlib.sha256(source.encode("utf-8")).hexdigest()[:8], 16) % 100
    return next(name for name, upper in SPLITS if bucket < upper)


def split_pairs(pairs):
    """Deduplicated pairs grouped by `split_of(source)`: `{"train": [...], "validation": [...], "test": [...]}`."""
    splits = {name: [] for name, _ in SPLITS}
    for pair in dict.fromkeys(pairs):  # deduplicate, keep first-seen order
        splits[split_of(pair[0])].append(pair)
    return splits


def read_mo(path):
    """(msgid, msgstr) pairs of one compiled gettext catalog; plural, context and empty entries skipped."""
    try:
        catalog = polib.mofile(path)
    except (UnicodeDecodeError, OSError, LookupError, ValueError, struct.error) as error:  # legacy charset, corrupt
        reason = " ".join(str(error).split())[:200]  # one line, whatever the error says
        print(f"tfformer: skipping catalog {path}: {type(error).__name__}: {reason}", file=sys.stderr)
        return []
    return [
        (entry.msgid, entry.msgstr)
        for entry in catalog
        if entry.msgid and entry.msgstr and not entry.msgid_plural and entry.msgctxt is None
    ]


def gettext_pairs(target_language="de", locale_dir=DEFAULT_LOCALE_DIR):
    """An English -> `target_language` parallel corpus from the machine's gettext catalogs.

    Reads `<locale_dir>/<target_language>/LC_MESSAGES/*.mo` in sorted order and returns
    `split_pairs(...)`: train/validation/test by a stable hash of the English source.
    """
    folder = os.path.join(locale_dir, target_language, "LC_MESSAGES")
    files = sorted(glob.glob(os.path.join(folder, "*.mo")))
    if not files:
        available = sorted(
            name for name in os.listdir(locale_dir) if glob.glob(os.path.join(locale_dir, name, "LC_MESSAGES", "*.mo"))
        ) if os.path.isdir(locale_dir) else []
        raise ValueError(
            f"No gettext catalogs (*.mo) for language {target_language!r} in {folder}. "
            f"Languages with catalogs here: {available[:20] or 'none'}. Catalogs come with any Debian "
            "package's translations (e.g. `apt-get install coreutils`), or pass your own pairs with --data file.tsv."
        )
    pairs = [pair for path in files for pair in read_mo(path)]
    return split_pairs(pairs)


def read_tsv_pairs(path):
    """Source<TAB>target lines of a UTF-8 file, split like `gettext_pairs`.

    Literal `\\t`, `\\n` and `\\\\` inside a field are unescaped, so texts may hold them.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"Data file {str(path)!r} does not exist.")
    pairs = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.rstrip("\n").rstrip("\r")
            if not line:
                continue
            if "\t" not in line:
                raise ValueError(f"{path}:{number}: expected 'source<TAB>target', found no tab.")
            source, target = line.split("\t", 1)
            pairs.append((_unescape(source), _unescape(target)))
    if not pairs:
        raise ValueError(f"Data file {str(path)!r} holds no source<TAB>target pairs.")
    return split_pairs(pairs)


def _unescape(text):
    return text.replace("\\\\", "\x00").replace("\\t", "\t").replace("\\n", "\n").replace("\x00", "\\")


def text_corpus(paths=None):
    """Lines of text for language modelling. Default: the Python standard library's own `.py` files."""
    if not paths:
        stdlib = pathlib.Path(os.__file__).parent
        paths = sorted(str(p) for p in stdlib.glob("*.py"))
    texts = []
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"Text file {path!r} does not exist.")
        with open(path, encoding="utf-8", errors="replace") as handle:
            texts.extend(line.rstrip("\n") for line in handle if line.strip())
    if not texts:
        raise ValueError(f"The text files {list(paths)[:5]} are empty.")
    return texts


def tfds_pairs(name, source_key, target_key, data_dir=None):
    """Pairs from a TensorFlow Datasets dataset already downloaded under `data_dir` (never downloads)."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as error:
        raise ValueError("TensorFlow Datasets is not installed: `pip install tensorflow-datasets`.") from error
    builder = tfds.builder(name, data_dir=data_dir)
    if not builder.is_prepared():
        raise ValueError(f"TFDS dataset {name!r} is not downloaded under {builder.data_dir}; nothing is fetched at "
                         "run time.")
    pairs = [
        (ex[source_key].decode("utf-8"), ex[target_key].decode("utf-8"))
        for split in builder.info.splits
        for ex in tfds.as_numpy(builder.as_dataset(split=split))
    ]
    return split_pairs(pairs)
