"""A tiny English->French run trained by the recipe: nothing is German-specific, its .po passes msgfmt, and its
edge decoders (float32 TFLite) translate exactly as its SavedModel does, beam search included."""

import glob
import importlib.util
import json
import os
import shutil

import keras
import numpy as np
import polib
import pytest

from tests.recipes.catalogs import edge_whitespace, msgfmt
from tfformer import cli, data, edge, generation
from tfformer.data import placeholders
from tfformer.recipes import rundir, translation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MO_CANDIDATES = ["coreutils.mo", "grep.mo", "sed.mo", "tar.mo", "apt.mo", "dpkg.mo"]
TINY = dict(hidden_dim=32, num_heads=2, intermediate_dim=64, num_encoder_layers=1, num_decoder_layers=1, dropout=0.0)
# What the edge must carry exactly like the SavedModel: edge newlines, runs of spaces, tabs and inner newlines,
# printf conversions, tags, accelerators, accents.
TEXTS = ["\nCannot open the file %s\n", "Invalid  argument:   %s\n\n", "  Write   error\t", "\n\n_Open the file",
         "%s: cannot remove «%s» (déjà vu)\n", "Line one\nline two  %d", "<b>Usage:</b> %s [OPTION]...\n",
         "Élément invalide: %1$s %2$d\n", "memory exhausted"]


def _fr_catalog():
    folder = os.path.join(data.corpora.DEFAULT_LOCALE_DIR, "fr", "LC_MESSAGES")
    found = [os.path.join(folder, name) for name in MO_CANDIDATES if os.path.exists(os.path.join(folder, name))]
    found = found or sorted(glob.glob(os.path.join(folder, "*.mo")))
    if not found:
        pytest.skip("no French gettext catalog (*.mo) on this machine")
    return polib.mofile(found[0])


@pytest.fixture(scope="module")
def catalog():
    return _fr_catalog()


@pytest.fixture(scope="module")
def fr_run(tmp_path_factory, catalog):
    """`train_translation(target_language="fr")` on 600 pairs of a French catalog, 150 steps, the weights of the
    last two evaluations averaged."""
    folder = tmp_path_factory.mktemp("fr")
    pairs = [(e.msgid, e.msgstr) for e in catalog if e.msgid and e.msgstr and not e.msgid_plural and len(e.msgid) < 70
             and "\r" not in e.msgid + e.msgstr]
    escape = lambda text: text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")  # noqa: E731
    tsv = folder / "pairs.tsv"
    tsv.write_text("".join(f"{escape(s)}\t{escape(t)}\n" for s, t in pairs[:600]), encoding="utf-8")
    out = str(folder / "run")
    printed = []
    metrics = translation.train_translation(
        out, target_language="fr", data_file=str(tsv), time_budget="10m", batch_size=16, vocabulary_size=400,
        warmup_steps=100, eval_every=50, max_steps=150, average_last=2, printer=printed.append, **TINY)
    return {"dir": out, "metrics": metrics, "printed": printed, "work": str(folder / "edge")}


@pytest.fixture(scope="module")
def parity_tool():
    spec = importlib.util.spec_from_file_location("edge_parity", os.path.join(ROOT, "tools", "edge_parity.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_french_run_is_a_run_like_the_german_one(fr_run):
    metrics, run = fr_run["metrics"], fr_run["dir"]
    assert metrics["steps"] == 150 and metrics["averaged_checkpoints"] == 2
    assert 0 <= metrics["bleu_test"] <= 100 and 0 < metrics["chrf_test"] <= 100 and metrics["test_pairs"] > 0
    assert rundir.read_json(os.path.join(run, translation.RUN_FILE))["target_language"] == "fr"
    for name in (translation.MODEL_FILE, translation.TOKENIZER_FILE, "loss.png", translation.LAST_WEIGHTS_FILE):
        assert os.path.exists(os.path.join(run, name)), name
    assert any("the mean of the last 2 evaluations" in line for line in fr_run["printed"])
    assert (metrics["beam_size"], metrics["length_penalty"]) == (translation.BEAM_SIZE, translation.LENGTH_PENALTY)
    # What tools/edge_parity.py scores: the pairs the run's own evaluation scored.
    pairs = translation.evaluation_pairs(run)
    assert len(pairs) == metrics["test_pairs"] and all(isinstance(s, str) and t for s, t in pairs)
    with pytest.raises(ValueError, match="split"):
        translation.evaluation_pairs(run, "dev")


def test_a_french_pot_becomes_a_po_that_msgfmt_accepts(fr_run, catalog, tmp_path, capsys):
    entries = [e for e in catalog if e.msgid]
    plural = [e for e in entries if e.msgid_plural][:3]
    printf = [e for e in entries if "%" in e.msgid and not e.msgid_plural][:8]
    edges = [e for e in entries if not e.msgid_plural and (e.msgid[:1] in "\n " or e.msgid[-1:] in "\n ")][:4]
    picked = list(dict.fromkeys(plural + printf + edges + entries[:6]))
    assert plural, "the French catalog has no plural entry to test with"
    pot = polib.POFile(wrapwidth=78)
    pot.metadata = {"Project-Id-Version": "test", "Language": "", "MIME-Version": "1.0",
                    "Content-Type": "text/plain; charset=CHARSET", "Content-Transfer-Encoding": "ENCODING",
                    "Plural-Forms": "nplurals=INTEGER; plural=EXPRESSION;"}
    for e in picked:
        entry = polib.POEntry(msgid=e.msgid, msgid_plural=e.msgid_plural, msgctxt=e.msgctxt)
        if e.msgid_plural:
            entry.msgstr_plural = {0: "", 1: ""}
        if any(placeholders.is_ordered(p) for p in placeholders.find_placeholders(e.msgid)):
            entry.flags.append("c-format")
        pot.append(entry)
    pot.save(str(tmp_path / "messages.pot"))
    out = str(tmp_path / "fr.po")
    assert cli.main(["translate", "--run", fr_run["dir"], "--po", str(tmp_path / "messages.pot"), "--out", out,
                     "--max-new-tokens", "24"]) == 0
    assert "marked fuzzy" in capsys.readouterr().err
    for flags in ((), ("--use-fuzzy",)):
        checked = msgfmt(out, *flags)
        assert checked.returncode == 0, checked.stderr
    po = polib.pofile(out)
    assert po.metadata["Plural-Forms"] == "nplurals=2; plural=(n > 1);" and po.metadata["Language"] == "fr"
    assert len(po) == len(picked) and all("fuzzy" in e.flags for e in po)
    for e in po:
        targets = [(e.msgid, e.msgstr_plural[0]), (e.msgid_plural, e.msgstr_plural[1])] if e.msgid_plural \
            else [(e.msgid, e.msgstr)]
        for source, target in targets:
            assert target and edge_whitespace(target) == edge_whitespace(source), (source, target)
            printf = [p for p in placeholders.find_placeholders(source) if p.startswith("%")]
            assert [p for p in placeholders.find_placeholders(target) if p.startswith("%")] == printf


def test_edge_translates_exactly_like_the_saved_model(fr_run, parity_tool):
    """tools/edge_parity.py on texts with edge newlines, runs of spaces, placeholders and accents: the float32
    decoder gives the SavedModel's strings; int8's keep every placeholder and the edge whitespace."""
    report = parity_tool.compare(fr_run["dir"], TEXTS, work=fr_run["work"], printer=lambda *_: None)
    served = report["translations"]["saved_model"]
    assert report["translations"]["float32"] == served, report["differences"]
    assert report["exact_match"]["float32"] == 1.0 and report["difference_kinds"]["decoding"] == 0
    assert sum(out != text for out, text in zip(served, TEXTS)) >= len(TEXTS) - 1  # the model did translate
    for text, out in zip(TEXTS, report["translations"]["int8"]):
        assert edge_whitespace(out) == edge_whitespace(text) and sorted(placeholders.find_placeholders(out)) == sorted(
            placeholders.find_placeholders(text)), (text, out)
    assert 0 <= report["exact_match"]["int8"] <= 1
    assert report["printf_and_newlines_kept"] == {"saved_model": 1.0, "float32": 1.0, "int8": 1.0}
    # The check itself: a lost conversion or edge newline is seen.
    assert parity_tool.kept("%u freed (%.2f%%).\n", "%u freigegeben (%.2f%%).\n")
    assert not parity_tool.kept("%u freed (%.2f%%).\n", "%u.2f.2f).\n%%")
    assert not parity_tool.kept("\nDone.", "Fertig.") and not parity_tool.kept("Done.\n", "Fertig.")


@pytest.mark.parametrize("beam_size, length_penalty", [(1, 0.6), (3, 0.6), (4, 1.0)])
def test_edge_beam_search_equals_the_beam_sampler(fr_run, parity_tool, beam_size, length_penalty):
    """`Generator.translate(beam_size=...)` picks the ids `BeamSampler` (the SavedModel's decode loop) picks."""
    model = translation.load_run(fr_run["dir"])
    _, decoders = parity_tool.build(fr_run["dir"], fr_run["work"], printer=lambda *_: None)
    gen = edge.Generator(decoders["float32"])
    sources = [placeholders.mask(text).text for text in TEXTS]
    chosen = []
    for source in sources:
        ids = model.preprocessor.tokenize([source]).to_list()[0]
        expected = generation.generate_ids(model, np.array([ids], "int32"), 20, beam_size=beam_size,
                                           length_penalty=length_penalty, jit_compile=False).numpy()[0].tolist()
        expected = expected[: expected.index(3) + 1] if 3 in expected else expected
        got = gen.translate(ids, max_new_tokens=20, beam_size=beam_size, length_penalty=length_penalty)
        assert got == expected, source
        chosen.append(got)
    if beam_size == 1:  # beam size 1 is greedy decoding
        assert chosen == [gen.translate(model.preprocessor.tokenize([s]).to_list()[0], max_new_tokens=20)
                          for s in sources]
    with pytest.raises(ValueError, match="beam_size"):
        gen.translate([5, 6], beam_size=0)


def test_weight_snapshots_average_the_last_ones():
    """`WeightSnapshots(every=2, keep=3)` over 7 steps keeps steps 4, 6 and 7; `average()` is their mean."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    seen = []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(model.get_weights()))
    snapshots = translation.WeightSnapshots(every=2, keep=3)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(7, 3)).astype("float32"), rng.normal(size=(7, 2)).astype("float32")
    model.fit(x, y, batch_size=1, epochs=1, callbacks=[record, snapshots], verbose=0)
    assert len(seen) == 7 and len(snapshots.snapshots) == 3
    for got, *steps in zip(snapshots.average(), seen[3], seen[5], seen[6]):
        np.testing.assert_allclose(got, np.mean(steps, axis=0), rtol=1e-6)
    assert not np.allclose(snapshots.average()[0], seen[6][0])  # the weights moved: a real average


def test_stop_after_steps_and_bad_options(tmp_path):
    with pytest.raises(ValueError, match="average_last"):
        translation.train_translation(str(tmp_path / "run"), data_file=str(tmp_path / "x.tsv"), average_last=-1)
    with pytest.raises(ValueError, match="max_steps"):
        translation.train_translation(str(tmp_path / "run"), data_file=str(tmp_path / "x.tsv"), max_steps=1.5)


def test_catalog_check_tool_passes_msgfmt_on_a_test_split_catalog(fr_run, tmp_path):
    """tools/catalog_check.py (issue 43's check on a trained run): the French catalog with the most printf and
    edge-newline messages in the test split, remade as a .pot, translated, accepted by msgfmt, nothing lost."""
    if shutil.which("msgfmt") is None:
        pytest.skip("GNU gettext's msgfmt is not installed (Debian package `gettext`)")
    spec = importlib.util.spec_from_file_location("catalog_check", os.path.join(ROOT, "tools", "catalog_check.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    work = tmp_path / "check"
    assert tool.main(["--run", fr_run["dir"], "--catalogs", "1", "--order", "printf", "--work", str(work)]) == 0
    rows = [json.loads(line) for line in (work / "catalog_check-test-printf.jsonl").read_text().splitlines()]
    row, summary = rows
    assert row["c_format_entries"] > 0 and row["msgfmt"] == {"default": 0, "--use-fuzzy": 0}
    assert (summary["dropped"], summary["altered"], summary["printf_or_edge_newline_lost"]) == (0, 0, 0)
    assert row["translated"] == row["entries"] > 0
