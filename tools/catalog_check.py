"""Issue 43's catalog acceptance on a trained run: .pot files remade from the machine's catalogs, translated by
`translation.translate_catalog`, checked by GNU msgfmt.

For each of the `--catalogs` catalogs of `/usr/share/locale/<lang>/LC_MESSAGES/` with the most messages in the
recipe's test split, a template is rebuilt from the `.mo` as xgettext would write it (English msgids, plurals and
contexts, `c-format` where the msgid has a printf conversion, no translations), keeping the entries whose msgid
the run never trained on (`--entries test`, the default) or all of them (`--entries all`). Each is translated
into a `.po`, and the script records:

- `msgfmt --check-format` and `msgfmt --check-format --use-fuzzy` exit codes (0: accepted);
- entries dropped or altered: anything but `msgstr`/`msgstr_plural` and the added `fuzzy` flag that differs;
- printf conversions and edge newlines lost (`tools/edge_parity.kept`, written apart from the library's patterns).

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/catalog_check.py --run RUN [--catalogs 5] [--entries test|all]
        [--order messages|printf]

prints one JSON line per catalog and a summary, and writes them to `--work` (default: a new temporary directory,
printed).
"""

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import time

import polib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from edge_parity import PRINTF, cpu_model, kept, work_dir

from tfformer.data import corpora
from tfformer.recipes import rundir, translation


def catalogs_by_test_messages(language, order="messages", locale_dir=corpora.DEFAULT_LOCALE_DIR):
    """`[(path, number of msgids in the test split)]`, most first (`order="printf"`: most test msgids with a printf
    conversion or an edge newline first); catalogs polib cannot read are left out."""
    counts = []
    folder = os.path.join(locale_dir, language, "LC_MESSAGES")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".mo"):
            continue
        try:
            mo = polib.mofile(os.path.join(folder, name))
        except (UnicodeDecodeError, OSError, LookupError, ValueError):
            continue
        test = [e.msgid for e in mo if e.msgid and corpora.split_of(e.msgid) == "test"]
        hard = [t for t in test if PRINTF.search(t) or t[:1] == "\n" or t[-1:] == "\n"]
        counts.append((os.path.join(folder, name), len(test), len(hard)))
    key = 2 if order == "printf" else 1
    return [(path, count) for path, count, _ in sorted(counts, key=lambda item: -item[key])]


def template_from_mo(mo_path, entries="test"):
    """A `polib.POFile` template of the catalog's messages (see the module docstring)."""
    pot = polib.POFile(wrapwidth=78)
    pot.metadata = {"Project-Id-Version": os.path.basename(mo_path), "Language": "", "MIME-Version": "1.0",
                    "Content-Type": "text/plain; charset=CHARSET", "Content-Transfer-Encoding": "ENCODING",
                    "Plural-Forms": "nplurals=INTEGER; plural=EXPRESSION;"}
    pot.metadata_is_fuzzy = True
    for number, e in enumerate(polib.mofile(mo_path)):
        if not e.msgid or (entries == "test" and corpora.split_of(e.msgid) != "test"):
            continue
        entry = polib.POEntry(msgid=e.msgid, msgid_plural=e.msgid_plural, msgctxt=e.msgctxt,
                              occurrences=[("src/main.c", str(number + 1))])
        if e.msgid_plural:
            entry.msgstr_plural = {0: "", 1: ""}
        texts = [e.msgid] + ([e.msgid_plural] if e.msgid_plural else [])
        if all(PRINTF.search(t.replace("%%", "")) for t in texts):
            entry.flags.append("c-format")
        pot.append(entry)
    return pot


def msgfmt(path, *flags):
    return subprocess.run(["msgfmt", "--check-format", *flags, "-o", os.devnull, path], capture_output=True,
                          text=True)


def check(run, mo_path, work, entries="test"):
    name = os.path.splitext(os.path.basename(mo_path))[0]
    pot = template_from_mo(mo_path, entries)
    pot_path, po_path = os.path.join(work, name + ".pot"), os.path.join(work, name + ".po")
    pot.save(pot_path)
    start = time.monotonic()
    result = translation.translate_catalog(run, pot_path, po_path, overwrite=True, progress=False)
    seconds = time.monotonic() - start
    before, after = polib.pofile(pot_path), polib.pofile(po_path)
    altered = dropped = lost = texts = 0
    for old, new in zip(before, after):
        same = (new.msgid, new.msgid_plural, new.msgctxt, new.occurrences, new.comment, new.tcomment,
                new.flags) == (old.msgid, old.msgid_plural, old.msgctxt, old.occurrences, old.comment,
                               old.tcomment, ["fuzzy"] + old.flags)
        altered += not same
        targets = ([(old.msgid, new.msgstr_plural.get(0, "")), (old.msgid_plural, new.msgstr_plural.get(1, ""))]
                   if old.msgid_plural else [(old.msgid, new.msgstr)])
        for source, target in targets:
            texts += 1
            lost += not target or not kept(source, target)
    dropped = len(before) - len(after)
    checks = {flags or "default": msgfmt(po_path, *([flags] if flags else [])) for flags in ("", "--use-fuzzy")}
    return {"catalog": name, "entries": len(before), "plural_entries": sum(bool(e.msgid_plural) for e in before),
            "c_format_entries": sum("c-format" in e.flags for e in before), "translated": result["translated"],
            "seconds": round(seconds, 1), "dropped": dropped, "altered": altered, "texts": texts,
            "printf_or_edge_newline_lost": lost,
            "msgfmt": {k: v.returncode for k, v in checks.items()},
            "msgfmt_errors": {k: v.stderr[-500:] for k, v in checks.items() if v.returncode}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a translation run directory")
    parser.add_argument("--catalogs", type=int, default=5, help="how many catalogs (most test messages first)")
    parser.add_argument("--entries", default="test", choices=["test", "all"])
    parser.add_argument("--order", default="messages", choices=["messages", "printf"],
                        help="pick the catalogs with the most test messages, or with the most printf/edge-newline ones")
    parser.add_argument("--work", help="where the .pot/.po files and results go")
    args = parser.parse_args(argv)
    if shutil.which("msgfmt") is None:
        parser.error("GNU gettext's msgfmt is not installed (Debian package `gettext`)")
    language = rundir.read_json(os.path.join(args.run, translation.RUN_FILE)).get("target_language", "de")
    work = work_dir(args.work, "catalog-check", args.run)
    print(f"work directory: {work}")
    picked = [path for path, count in catalogs_by_test_messages(language, args.order) if count][: args.catalogs]
    rows = []
    for path in picked:
        rows.append(check(args.run, path, work, args.entries))
        print(json.dumps(rows[-1], ensure_ascii=False), flush=True)
    total = collections.Counter()
    for row in rows:
        total.update({k: row[k] for k in ("entries", "texts", "dropped", "altered", "printf_or_edge_newline_lost")})
    summary = {"run": os.path.abspath(args.run), "cpu": cpu_model(), "entries_kind": args.entries, "order": args.order,
               "catalogs": len(rows), "msgfmt_accepted": sum(all(v == 0 for v in r["msgfmt"].values()) for r in rows),
               **total, "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    print(json.dumps(summary))
    with open(os.path.join(work, f"catalog_check-{args.entries}-{args.order}.jsonl"), "w") as handle:
        for row in rows + [summary]:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return 0 if summary["msgfmt_accepted"] == len(rows) and not (
        total["dropped"] or total["altered"] or total["printf_or_edge_newline_lost"]) else 1


if __name__ == "__main__":
    sys.exit(main())
