"""`tfformer translate --po`: a .pot made from one of the machine's catalogs comes back as a .po msgfmt accepts."""

import glob
import json
import os
import re

import polib
import pytest

from tests.recipes.catalogs import edge_whitespace, msgfmt
from tfformer import cli, data, models
from tfformer.data import placeholders
from tfformer.recipes import translation

MO_CANDIDATES = ["Linux-PAM.mo", "pg_waldump-15.mo", "man-db.mo", "sed.mo", "xz.mo", "apt.mo"]
CFG = dict(hidden_dim=16, num_heads=2, intermediate_dim=32, num_encoder_layers=1, num_decoder_layers=1, dropout=0.0,
           max_sequence_length=32)


def _mo_path():
    for name in MO_CANDIDATES:
        path = os.path.join(data.corpora.DEFAULT_LOCALE_DIR, "de", "LC_MESSAGES", name)
        if os.path.exists(path):
            return path
    found = sorted(glob.glob(os.path.join(data.corpora.DEFAULT_LOCALE_DIR, "de", "LC_MESSAGES", "*.mo")))
    if not found:
        pytest.skip("no German gettext catalog (*.mo) on this machine to make a template from")
    return found[0]


def _c_format(text):
    found = placeholders.find_placeholders(text)
    return any(placeholders.is_ordered(p) or p.startswith("%") and p != "%" for p in found) and "%" not in found


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A .pot from the .mo (English msgids, a header without Plural-Forms) with the entries that matter first:
    plurals, leading/trailing newlines, printf conversions; the first three keep their German translation."""
    mo = polib.mofile(_mo_path())
    entries = [e for e in mo if e.msgid]
    plural = [e for e in entries if e.msgid_plural][:4]
    edges = [e for e in entries if e.msgid[:1] in "\n " or e.msgid[-1:] in "\n "][:8]
    printf = [e for e in entries if "%" in e.msgid][:16]
    first = [e for e in entries if not e.msgid_plural][:3]  # these keep their translation
    picked = list(dict.fromkeys(first + plural + edges + printf + entries[:8]))[:36]
    pot = polib.POFile(wrapwidth=78)
    pot.metadata = {"Project-Id-Version": "test", "Language": "", "MIME-Version": "1.0",  # as xgettext writes it
                    "Content-Type": "text/plain; charset=CHARSET", "Content-Transfer-Encoding": "ENCODING",
                    "Plural-Forms": "nplurals=INTEGER; plural=EXPRESSION;"}
    pot.metadata_is_fuzzy = True
    for number, e in enumerate(picked):
        entry = polib.POEntry(msgid=e.msgid, msgid_plural=e.msgid_plural, msgctxt=e.msgctxt,
                              occurrences=[(f"src/file{number}.c", str(10 + number))],
                              comment=f"extracted comment {number}", tcomment=f"translator note {number}")
        if e.msgid_plural:
            entry.msgstr_plural = {0: "", 1: ""}
        if _c_format(e.msgid) and (not e.msgid_plural or _c_format(e.msgid_plural)):
            entry.flags.append("c-format")
        pot.append(entry)
    for entry, original in list(zip(pot, picked))[:3]:
        if original.msgid_plural:
            entry.msgstr_plural = dict(original.msgstr_plural)
        else:
            entry.msgstr = original.msgstr
    path = tmp_path_factory.mktemp("catalog") / "messages.pot"
    pot.save(str(path))
    assert sum(bool(e.msgid_plural) for e in pot[3:]) >= 1 and sum("c-format" in e.flags for e in pot) >= 3
    return str(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An untrained tiny model: protection does not depend on what the model emits."""
    out = tmp_path_factory.mktemp("run")
    texts = ["open the file", "Datei öffnen", "cannot read %s", "kann %s nicht lesen", "Usage: %s [OPTION]..."] * 10
    tokenizer = data.SubwordTokenizer.train(texts, vocabulary_size=64)
    model = models.build_seq2seq(models.TransformerConfig(vocabulary_size=tokenizer.vocabulary_size, **CFG))
    model.save(str(out / translation.MODEL_FILE))
    tokenizer.save(str(out / translation.TOKENIZER_FILE))
    (out / translation.RUN_FILE).write_text(json.dumps(dict(target_language="de", max_length=32)))
    return str(out)


def test_pot_from_the_machine_becomes_a_po_that_msgfmt_accepts(template, run, tmp_path, capsys):
    out = str(tmp_path / "de.po")
    assert cli.main(["translate", "--run", run, "--po", template, "--out", out, "--batch-size", "8",
                     "--max-new-tokens", "12"]) == 0
    err = capsys.readouterr().err
    assert "marked fuzzy" in err and re.search(r"translating \[#+\] ([0-9]+)/\1 messages\n", err), err  # progress
    for flags in ((), ("--use-fuzzy",)):  # fuzzy entries are only checked with --use-fuzzy
        checked = msgfmt(out, *flags)
        assert checked.returncode == 0, checked.stderr
    before, after = polib.pofile(template), polib.pofile(out)
    assert len(after) == len(before) and after.metadata["Plural-Forms"] == "nplurals=2; plural=(n != 1);"
    for number, (old, new) in enumerate(zip(before, after)):
        assert (new.msgid, new.msgid_plural, new.msgctxt, new.occurrences, new.comment, new.tcomment) == (
            old.msgid, old.msgid_plural, old.msgctxt, old.occurrences, old.comment, old.tcomment)
        if number < 3:  # already translated: untouched
            assert (new.msgstr, new.msgstr_plural, new.flags) == (old.msgstr, old.msgstr_plural, old.flags)
            continue
        assert new.flags == ["fuzzy"] + old.flags
        pairs = [(old.msgid, new.msgstr_plural[0]), (old.msgid_plural, new.msgstr_plural[1])] if old.msgid_plural \
            else [(old.msgid, new.msgstr)]
        for source, target in pairs:
            assert target
            printf = [p for p in placeholders.find_placeholders(source) if p.startswith("%")]
            assert [p for p in placeholders.find_placeholders(target) if p.startswith("%")] == printf, (source, target)
            assert edge_whitespace(target) == edge_whitespace(source), (source, target)


def test_nothing_to_translate_exits_0_and_writes_nothing(template, run, tmp_path, capsys):
    done = str(tmp_path / "done.po")
    assert cli.main(["translate", "--run", run, "--po", template, "--out", done, "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    again = str(tmp_path / "again.po")
    assert cli.main(["translate", "--run", run, "--po", done, "--out", again]) == 0
    assert "already translated" in capsys.readouterr().err and not os.path.exists(again)


def test_bad_outputs_and_lengths_are_refused_before_translating(template, run, tmp_path, capsys):
    """An `--out` that is a directory or in a missing one, and `--max-new-tokens 0`, exit 2 with one line naming
    them, before any work (0 is not the default length)."""
    (tmp_path / "folder").mkdir()
    for argv, message in (
        (["--po", template, "--out", str(tmp_path / "folder"), "--overwrite"], "Received a directory"),
        (["--po", template, "--out", str(tmp_path / "missing" / "de.po")], "is not a writable directory"),
        (["--po", template, "--out", str(tmp_path / "de.po"), "--max-new-tokens", "0"], "`max_new_tokens` must be"),
        (["--max-new-tokens", "0", "open the file"], "`max_new_tokens` must be"),
    ):
        assert cli.main(["translate", "--run", run, *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("tfformer: error:") and len(err.splitlines()) == 1 and message in err, err
    assert sorted(os.listdir(tmp_path)) == ["folder"]


def test_existing_output_needs_overwrite(template, run, tmp_path, capsys):
    out = tmp_path / "de.po"
    out.write_text("keep me")
    assert cli.main(["translate", "--run", run, "--po", template, "--out", str(out)]) == 2
    assert f"{out}: the output file exists; pass --overwrite" in capsys.readouterr().err
    assert out.read_text() == "keep me"
    assert cli.main(["translate", "--run", run, "--po", template, "--out", str(out), "--overwrite",
                     "--max-new-tokens", "4"]) == 0
    assert polib.pofile(str(out)).fuzzy_entries()
    capsys.readouterr()
    # The same from Python.
    result = translation.translate_catalog(run, template, str(tmp_path / "py.po"), max_new_tokens=4, progress=False)
    assert result["translated"] == len(polib.pofile(template).untranslated_entries()) > 0
    assert result["written"] == str(tmp_path / "py.po") and not capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=KLINGON-8\\n"\n\nmsgid "a"\nmsgstr ""\n',
     r"bad\.po:3: unknown encoding 'KLINGON-8'"),
    ('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n\nmsgid "a"\nmsgstr ""\nmsgid "b\n',
     r"bad\.po:7: malformed PO file \(expected a keyword and a quoted string, found 'msgid \"b'\)"),
    ('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n\nmsgid "a"\nmsgstr ""\n\nmsgstr "x"\n',
     r"bad\.po:8: malformed PO file \(Syntax error"),
    ('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n\nmsgid "caf\xe9"\nmsgstr ""\n',
     r"bad\.po:5: byte 0xe9 is not valid UTF-8"),
])
def test_bad_catalogs_name_file_and_line(tmp_path, run, capsys, content, message):
    path = tmp_path / "bad.po"
    path.write_bytes(content.encode("latin-1"))
    assert cli.main(["translate", "--run", run, "--po", str(path), "--out", str(tmp_path / "x.po")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tfformer: error:") and re.search(message, err), err


def test_plural_forms_of_a_three_form_language_pass_msgfmt(run, tmp_path):
    pot = polib.POFile()
    pot.metadata = {"Content-Type": "text/plain; charset=UTF-8", "Language": "ru"}
    pot.append(polib.POEntry(msgid="One file", msgid_plural="%d files", msgstr_plural={0: "", 1: ""},
                             flags=["c-format"]))
    pot.append(polib.POEntry(msgid="%d folder\n", msgid_plural="%d folders\n", msgstr_plural={0: "", 1: ""},
                             flags=["c-format"]))
    pot.save(str(tmp_path / "ru.pot"))
    translation.translate_catalog(run, str(tmp_path / "ru.pot"), str(tmp_path / "ru.po"), max_new_tokens=6)
    entries = polib.pofile(str(tmp_path / "ru.po"))
    assert entries.metadata["Plural-Forms"] == translation.PLURAL_FORMS["ru"]
    assert all(sorted(e.msgstr_plural) == [0, 1, 2] for e in entries)
    assert all("%d" in form for form in entries[0].msgstr_plural.values())  # form 0 serves 21, 31, ... too
    checked = msgfmt(str(tmp_path / "ru.po"), "--use-fuzzy")
    assert checked.returncode == 0, checked.stderr


def test_a_run_without_the_reserved_pieces_warns(tmp_path):
    tokenizer = data.SubwordTokenizer.train(["ab ba", "ba ab"] * 10, vocabulary_size=15)  # too small for them
    model = models.build_seq2seq(models.TransformerConfig(vocabulary_size=tokenizer.vocabulary_size, **CFG))
    model.save(str(tmp_path / translation.MODEL_FILE))
    tokenizer.save(str(tmp_path / translation.TOKENIZER_FILE))
    with pytest.warns(UserWarning, match="trained before placeholder masking"):
        translation.load_run(str(tmp_path))
