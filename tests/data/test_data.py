import os
import struct

import numpy as np
import pytest
import tensorflow as tf

from tfformer import data

LOCALE_DIR = "/usr/share/locale"


def _write_mo(path, entries):
    """A minimal GNU .mo file (little-endian, no hash table)."""
    keys = sorted(entries)
    ids = b"".join(k.encode() + b"\0" for k in keys)
    strs = b"".join(entries[k].encode() + b"\0" for k in keys)
    n = len(keys)
    key_start = 7 * 4 + 16 * n
    value_start = key_start + len(ids)
    pos_k, pos_v = 0, 0
    koffsets, voffsets = [], []
    for k in keys:
        kb, vb = k.encode(), entries[k].encode()
        koffsets += [len(kb), key_start + pos_k]
        voffsets += [len(vb), value_start + pos_v]
        pos_k += len(kb) + 1
        pos_v += len(vb) + 1
    header = struct.pack("Iiiiiii", 0x950412DE, 0, n, 7 * 4, 7 * 4 + 8 * n, 0, 0)
    with open(path, "wb") as handle:
        handle.write(header + struct.pack(f"{2 * n}i", *koffsets) + struct.pack(f"{2 * n}i", *voffsets) + ids + strs)


def test_gettext_pairs_parses_skips_and_splits(tmp_path):
    folder = tmp_path / "xx" / "LC_MESSAGES"
    folder.mkdir(parents=True)
    entries = {
        "": "Content-Type: text/plain; charset=UTF-8\n",
        "Open file": "Datei öffnen",
        "Untranslated": "",
        "ctx\x04Save": "Speichern",
        "one file\x00%d files": "eine Datei\x00%d Dateien",
        "Error: %s\n": "Fehler: %s\n",
    }
    entries.update({f"Message number {i}": f"Nachricht {i}" for i in range(200)})
    _write_mo(folder / "a.mo", entries)
    _write_mo(folder / "b.mo", {"": "Content-Type: text/plain; charset=UTF-8\n", "Open file": "Datei öffnen"})
    splits = data.gettext_pairs("xx", locale_dir=str(tmp_path))
    pairs = [p for split in splits.values() for p in split]
    assert ("Open file", "Datei öffnen") in pairs and ("Error: %s\n", "Fehler: %s\n") in pairs
    assert len(pairs) == len(set(pairs)) == 202  # deduplicated; plural, context, header, empty skipped
    assert all(data.split_of(s) == name for name, split in splits.items() for s, _ in split)
    assert 0 < len(splits["test"]) + len(splits["validation"]) < len(splits["train"])


@pytest.mark.parametrize("content", [b"garbage", b"truncated", b"\xde\x12\x04\x95" + b"\0" * 8])
def test_an_unreadable_catalog_is_skipped_in_one_line(tmp_path, capsys, content):
    folder = tmp_path / "xx" / "LC_MESSAGES"
    folder.mkdir(parents=True)
    _write_mo(folder / "a.mo", {"": "Content-Type: text/plain; charset=UTF-8\n", "Open file": "Datei öffnen"})
    if content == b"truncated":  # a real catalog cut short: its tables point past the end
        content = (folder / "a.mo").read_bytes()[:40]
    (folder / "b.mo").write_bytes(content)
    splits = data.gettext_pairs("xx", locale_dir=str(tmp_path))
    assert [p for split in splits.values() for p in split] == [("Open file", "Datei öffnen")]
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"tfformer: skipping catalog {folder / 'b.mo'}: "), err


def test_split_is_stable():
    # A fixed hash: the same on every machine and Python run.
    assert [data.split_of(s) for s in ["Open file", "Quit", "Cancel", "%s: %s"]] == [
        data.split_of("Open file"), data.split_of("Quit"), data.split_of("Cancel"), data.split_of("%s: %s")]
    import hashlib
    assert data.split_of("Open file") == ("test" if int(hashlib.sha256(b"Open file").hexdigest()[:8], 16) % 100 < 2
                                          else "validation"
                                          if int(hashlib.sha256(b"Open file").hexdigest()[:8], 16) % 100 < 4
                                          else "train")


def test_missing_language_error(tmp_path):
    with pytest.raises(ValueError, match=r"'zz'.*LC_MESSAGES.*--data"):
        data.gettext_pairs("zz", locale_dir=str(tmp_path))


def test_tsv(tmp_path):
    good = tmp_path / "pairs.tsv"
    good.write_text("Hello\tHallo\nTab\\there\tTab\\tda\n", encoding="utf-8")
    pairs = [p for split in data.read_tsv_pairs(good).values() for p in split]
    assert sorted(pairs) == sorted([("Hello", "Hallo"), ("Tab\there", "Tab\tda")])
    bad = tmp_path / "bad.tsv"
    bad.write_text("Hello\tHallo\nno tab here\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.tsv:2: .*no tab"):
        data.read_tsv_pairs(bad)
    empty = tmp_path / "empty.tsv"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="no source<TAB>target"):
        data.read_tsv_pairs(empty)
    with pytest.raises(ValueError, match="does not exist"):
        data.read_tsv_pairs(tmp_path / "missing.tsv")


@pytest.fixture(scope="module")
def de_corpus():
    if not os.path.isdir(os.path.join(LOCALE_DIR, "de", "LC_MESSAGES")):
        pytest.skip("no German gettext catalogs on this machine")
    return data.gettext_pairs("de")


def test_real_corpus_size(de_corpus):
    total = sum(len(split) for split in de_corpus.values())
    assert total > 40000


def test_tokenizer_round_trips_the_corpus_exactly(de_corpus, tmp_path):
    texts = [s for pair in de_corpus["train"] for s in pair]
    tokenizer = data.SubwordTokenizer.train(texts, vocabulary_size=8192)
    assert 4000 < tokenizer.vocabulary_size <= 8192
    ids = tokenizer.tokenize(texts)
    back = [b.decode("utf-8") for b in tokenizer.detokenize(ids).numpy()]
    unk = set(np.nonzero([data.UNK_ID in row for row in ids.to_list()])[0])
    mismatched = [i for i, (a, b) in enumerate(zip(texts, back)) if a != b]
    # Only strings holding a character the vocabulary lacks (control characters) may differ.
    assert set(mismatched) <= unk and len(mismatched) < 1e-3 * len(texts)
    for s in ["Fehler: %s\n", "  -v, --verbose\tausführlich", "'%s' nicht gefunden"]:
        assert tokenizer.detokenize(tokenizer.tokenize([s])).numpy()[0].decode() == s
    # Saved beside the model and reloaded: identical ids.
    reloaded = data.SubwordTokenizer.load(tokenizer.save(str(tmp_path / "tok.model")))
    assert reloaded.tokenize(texts[:500]).to_list() == ids[:500].to_list()


def test_translation_pipeline_teacher_forcing():
    tokenizer = data.SubwordTokenizer.train(["open the file", "close the file", "Datei öffnen", "Datei schließen"] * 20,
                                            vocabulary_size=40)
    pairs = [("open the file", "Datei öffnen"), ("close the file", "Datei schließen")] * 5
    ds = data.make_translation_dataset(pairs, tokenizer, batch_size=4, max_length=16, seed=1)
    batches = list(ds)
    assert sum(int(x["encoder_token_ids"].shape[0]) for x, _ in batches) == 10
    inputs, labels = batches[0]
    dec, lab = inputs["decoder_token_ids"].numpy(), labels.numpy()
    assert np.all(dec[:, 0] == data.START_ID)
    body = (lab[:, :-1] != 0) & (lab[:, :-1] != data.END_ID)
    np.testing.assert_array_equal(dec[:, 1:][body], lab[:, :-1][body])  # shifted by one
    lengths = (lab != 0).sum(1)
    assert np.all(lab[np.arange(len(lab)), lengths - 1] == data.END_ID)
    decoded = tokenizer.detokenize(tf.RaggedTensor.from_tensor(lab, padding=0)).numpy()
    assert set(d.decode() for d in decoded) <= {"Datei öffnen", "Datei schließen"}
    # The same seed gives the same order.
    again = [x["encoder_token_ids"].numpy().tolist()
             for x, _ in data.make_translation_dataset(pairs, tokenizer, 4, 16, seed=1)]
    assert again == [x["encoder_token_ids"].numpy().tolist() for x, _ in batches]
    # Autotuning off: with it, deleting an iterator after an epoch blocked for up to ~60 s (data/pipelines.py).
    assert ds.options().autotune.enabled is False


@pytest.mark.parametrize("bucket", [True, False])
def test_translation_pipeline_knows_its_length(bucket):
    """The number of batches is stated (tf.data checks it as it runs), so Keras' `fit` and `evaluate` know an
    epoch's end and do not warn "Your input ran out of data"."""
    import warnings

    import keras

    words = ["open", "the", "file", "close", "a", "new", "window", "save", "all", "documents", "now", "please"]
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=rng.integers(1, 30))) for _ in range(300)]
    tokenizer = data.SubwordTokenizer.train(texts, vocabulary_size=40)
    pairs = list(zip(texts, texts[::-1]))
    ds = data.make_translation_dataset(pairs, tokenizer, batch_size=8, max_length=20, bucket=bucket)
    counted = sum(1 for _ in ds)
    assert int(ds.cardinality()) == counted == sum(1 for _ in ds)  # reshuffled: the same count
    sizes = [int(x["encoder_token_ids"].shape[0]) for x, _ in ds]
    assert sum(sizes) == len(pairs) and (bucket or counted == -(-len(pairs) // 8))
    inputs = {name: keras.Input((None,), dtype="int32", name=name) for name in ("encoder_token_ids",
                                                                                "decoder_token_ids")}
    logits = keras.layers.Dense(40)(keras.layers.Embedding(40, 4)(inputs["decoder_token_ids"]))
    model = keras.Model(inputs, logits)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran out of data")
        model.fit(ds, validation_data=ds, epochs=2, shuffle=False, verbose=0)
        model.evaluate(ds, verbose=0)


def test_lm_pipeline():
    texts = ["def f(x):", "    return x + 1"] * 30
    tokenizer = data.SubwordTokenizer.train(texts, vocabulary_size=30)
    ds = data.make_lm_dataset(texts, tokenizer, sequence_length=8, batch_size=3, shuffle=False)
    inputs, labels = next(iter(ds))
    np.testing.assert_array_equal(inputs["token_ids"].numpy()[:, 1:], labels.numpy()[:, :-1])
    assert inputs["token_ids"].shape == (3, 8)
    assert ds.options().autotune.enabled is False  # see test_translation_pipeline_teacher_forcing


def test_id_to_piece():
    tokenizer = data.SubwordTokenizer.train(["open the file", "close the file"] * 20, vocabulary_size=30)
    ids = tokenizer.tokenize(["open the file"]).to_list()[0]
    assert "".join(tokenizer.id_to_piece(ids)).replace("\u2581", " ") == "open the file"  # ▁ marks a space


@pytest.mark.parametrize("argument, value", [("max_length", 0), ("max_length", -3), ("max_length", 2.5),
                                             ("batch_size", 0), ("batch_size", True)])
def test_translation_dataset_rejects_bad_sizes(argument, value):
    tokenizer = data.SubwordTokenizer.train(["open the file", "close the window"], vocabulary_size=40)
    with pytest.raises(ValueError, match=rf"`{argument}` must be a positive integer. Received: {argument}={value}"):
        data.make_translation_dataset([("open", "auf")], tokenizer, **{argument: value})


@pytest.mark.parametrize("kwargs, match", [
    # Before: a ZeroDivisionError, a TypeError, empty (B, 0) windows, a BatchDatasetV2 op error.
    (dict(sequence_length=-1), r"`sequence_length` must be a positive integer"),
    (dict(sequence_length=8.0), r"`sequence_length` must be a positive integer"),
    (dict(sequence_length=0), r"`sequence_length` must be a positive integer"),
    (dict(batch_size=0), r"`batch_size` must be a positive integer"),
    # One string was read as a list of lines: each character, then an end token.
    (dict(texts="def f(x):\n    return x + 1\n" * 30), r"`texts` must be a list of lines, not one string"),
])
def test_lm_dataset_rejects_bad_arguments(kwargs, match):
    texts = ["def f(x):", "    return x + 1"] * 30
    tokenizer = data.SubwordTokenizer.train(texts, vocabulary_size=30)
    with pytest.raises(ValueError, match=match):
        data.make_lm_dataset(**{"texts": texts, "tokenizer": tokenizer, **kwargs})


def test_subword_detokenize_names_ids_past_the_learned_vocabulary():
    # train() may learn fewer pieces than asked; SentencePiece's op said only "Sentencepiece conversion failed".
    tokenizer = data.SubwordTokenizer.train(["open the file", "close the window"] * 10, vocabulary_size=40)
    size = tokenizer.vocabulary_size
    assert tokenizer.detokenize([[5, size - 1]]).shape == (1,)
    for bad, match in (([[5, size]], f"`ids` must be below the vocabulary size {size}"),
                       ([[5, -1]], "`ids` must be non-negative")):
        with pytest.raises(tf.errors.InvalidArgumentError, match=match):
            tokenizer.detokenize(bad)
