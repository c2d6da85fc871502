import contextlib
import os
import random
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.harness import saved_model_in_fresh_process

from tfformer import export, generation
from tfformer.data import placeholders

TEXTS = ["open the file", "delete a file", "Error: %s\n", "", "save the folder and close the file"]
PROTECTED = ["\n  _Open %s file (%.2f%%)\t", "%u cached (%.2f%%)\n", "%1$s <b>the</b> {name} folder\n\n", "%s: %s\n",
             "\n", "close\tthe  file\nnow \u00fcber"]




@pytest.fixture(scope="module")
def translator_export(tmp_path_factory, seq2seq, tokenizer):
    """`(base path, version path)`: `seq2seq` exported once (max_new_tokens=12) into a new base path, for the tests
    that load it and do not write to it."""
    base = tmp_path_factory.mktemp("translator") / "models" / "translator"
    return base, export.saved_model(seq2seq, str(base), tokenizer=tokenizer, max_new_tokens=12)


@pytest.fixture(scope="module")
def short_export(tmp_path_factory, seq2seq, tokenizer):
    """`seq2seq` exported once (max_new_tokens=4) into a new base path: that base path (its version 1)."""
    base = tmp_path_factory.mktemp("short") / "m"
    assert export.saved_model(seq2seq, str(base), tokenizer=tokenizer, max_new_tokens=4) == str(base / "1")
    return base


@contextlib.contextmanager
def _preprocessor(task, tokenizer):
    """`task` with `tokenizer` as its preprocessor for a while (the fixtures are shared by the session)."""
    task.preprocessor = tokenizer
    try:
        yield task
    finally:
        task.preprocessor = None


def test_translation_saved_model_matches_keras_in_a_fresh_process(tmp_path, seq2seq, tokenizer, translator_export):
    base, path = translator_export
    assert path == str(base / "1") and sorted(os.listdir(base)) == ["1"]
    ids = tokenizer.tokenize(TEXTS[:3]).to_tensor().numpy()
    dec = np.array([[2, 5, 6], [2, 7, 0], [2, 0, 0]], "int32")
    out = saved_model_in_fresh_process(path, {
        "serving_default": {"text": [TEXTS + ["caf\xe9 \xff bytes"] + [t.encode().decode("latin-1") for t in PROTECTED],
                                     "bytes"]},
        "predict_ids": {"encoder_token_ids": [ids.tolist(), "int32"], "decoder_token_ids": [dec.tolist(), "int32"]},
    }, tmp_path)
    served = [s.decode("utf-8") for s in out["serving_default/translation"]]
    with _preprocessor(seq2seq, tokenizer):
        expected = seq2seq.translate([t for t in TEXTS if t], max_new_tokens=12)
        local_protected = seq2seq.translate(PROTECTED, max_new_tokens=12)
    assert [s for t, s in zip(TEXTS, served) if t] == expected  # same strings as `tfformer translate`
    # Placeholder protection in the graph: the same strings as the Python path, every placeholder kept.
    protected = served[len(TEXTS) + 1:]
    assert protected == local_protected
    for source, target in zip(PROTECTED, protected):
        assert sorted(placeholders.find_placeholders(target)) == sorted(placeholders.find_placeholders(source))
        start, end = source[: len(source) - len(source.lstrip())], source[len(source.rstrip()):]
        assert target.startswith(start) and target.endswith(end)
    assert served[TEXTS.index("")] == ""  # empty input -> empty output, no error
    assert any(len(s) > 3 for s in expected)
    keras_logits = np.asarray(seq2seq({"encoder_token_ids": ids, "decoder_token_ids": dec}))
    np.testing.assert_allclose(out["predict_ids/logits"], keras_logits, atol=1e-4)


def test_causal_lm_saved_model_and_generate_ids(tmp_path, causal_lm, tokenizer):
    path = export.saved_model(causal_lm, str(tmp_path / "lm"), tokenizer=tokenizer, max_new_tokens=6)
    prompts = ["open the", "Error"]
    out = saved_model_in_fresh_process(path, {"serving_default": {"text": [prompts, "bytes"]},
                        "generate_ids": {"token_ids": [[[5, 6, 7]], "int32"]}}, tmp_path)
    served = [s.decode("utf-8") for s in out["serving_default/continuation"]]
    with _preprocessor(causal_lm, tokenizer):
        assert served == causal_lm.generate(prompts, max_new_tokens=6)
    np.testing.assert_array_equal(out["generate_ids/token_ids"],
                                  generation.generate_ids(causal_lm, np.array([[5, 6, 7]], "int32"), 6).numpy())


def test_saved_model_cli_lists_the_signatures(short_export):
    path = str(short_export / "1")
    cli = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")
    out = subprocess.run([cli, "show", "--all", "--dir", path], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for name in ("serving_default", "predict_ids", "generate_ids", "encoder_token_ids", "translation", "logits"):
        assert name in out.stdout


def test_versions_are_numbered_and_never_overwritten(tmp_path, seq2seq, tokenizer, short_export):
    base = str(tmp_path / "m")
    shutil.copytree(short_export, base)  # version 1, numbered 1 in its empty base path (the fixture checks)
    export.saved_model(seq2seq, base, version=7, tokenizer=tokenizer, max_new_tokens=4)
    assert export.saved_model(seq2seq, base, tokenizer=tokenizer, max_new_tokens=4).endswith("/8")
    with pytest.raises(ValueError, match="already exists"):
        export.saved_model(seq2seq, base, version=7, tokenizer=tokenizer, max_new_tokens=4)
    with pytest.raises(ValueError, match="tokenizer"):
        export.saved_model(seq2seq, base, tokenizer=None, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        export.saved_model(seq2seq, base, tokenizer=tokenizer, max_new_tokens=0)
    assert sorted(os.listdir(base)) == ["1", "7", "8"]  # failed exports leave nothing behind


KILL_SCRIPT = """
import sys
from tfformer import export, data, models
import tests.export.conftest as c
tok = data.SubwordTokenizer.train([s for p in c.PAIRS for s in p] * 20, vocabulary_size=60)
model = c.spread(models.build_seq2seq(models.TransformerConfig(vocabulary_size=tok.vocabulary_size, **c.CFG)))
print("ready", flush=True)
while True:
    export.saved_model(model, sys.argv[1], tokenizer=tok, max_new_tokens=4)
    print("exported", flush=True)
"""


def test_killed_exports_leave_only_complete_versions(tmp_path):
    """SIGKILL the exporter while it writes a version, 5 times: base_path only ever holds loadable versions.

    Each kill waits for the export's hidden temporary directory to appear and then lands at a random moment of the
    write (its length timed on a first, complete export), so the kills hit the files being written on a loaded
    machine as on an idle one; a window of fixed seconds mostly killed the exporter while it traced, or before.
    """
    base = tmp_path / "base"
    script = tmp_path / "exporter.py"
    script.write_text(KILL_SCRIPT)
    log = tmp_path / "exporter.log"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

    exporters = []  # every process started, killed at the end whatever happens

    def start():
        with open(log, "w") as stderr:
            proc = subprocess.Popen([sys.executable, str(script), str(base)], env=env, stdout=subprocess.PIPE,
                                    stderr=stderr, text=True)
        exporters.append(proc)
        assert proc.stdout.readline().strip() == "ready", log.read_text()[-3000:]
        return proc

    def temporaries(pid=None):  # the writer's own when `pid` is given: not an earlier process's leftover
        return [n for n in os.listdir(base) if n.startswith(".tmp-") and (pid is None or n.endswith(f"-{pid}"))]

    def wait_for_write(proc):
        while not (base.exists() and temporaries(proc.pid)):
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.005)
        return time.monotonic()

    # A hung exporter is killed after 15 minutes: the blocking reads and waits then fail with its log.
    watchdog = threading.Timer(900, lambda: [proc.kill() for proc in exporters])
    watchdog.start()
    try:
        # A first, complete export: the length of its write sets the kill windows; its version is loaded at the end.
        proc = start()
        began = wait_for_write(proc)
        assert proc.stdout.readline().strip() == "exported", log.read_text()[-3000:]
        write_seconds = time.monotonic() - began
        rng = random.Random(0)
        interrupted = 0  # kills that left a half-written temporary behind
        for kill in range(5):
            if kill:
                proc = start()
            wait_for_write(proc)
            time.sleep(rng.uniform(0.0, write_seconds))
            proc.kill()
            proc.wait()
            interrupted += bool(temporaries(proc.pid))
            assert len(temporaries()) <= 1  # each export removed the temporaries of the exporters killed before
            for name in os.listdir(base):
                if name.isdigit():
                    assert (base / name / "saved_model.pb").exists() and (base / name / "variables").is_dir()
    finally:
        watchdog.cancel()
        for proc in exporters:
            proc.kill()
            proc.wait()
    assert interrupted >= 1, f"no kill landed inside a write ({write_seconds:.2f} s long)"
    versions = sorted(int(n) for n in os.listdir(base) if n.isdigit())
    assert versions, "no export completed"
    # Anything else is a killed export's hidden temporary directory, which TF Serving ignores.
    assert all(n.startswith(".tmp-") for n in os.listdir(base) if not n.isdigit())
    check = "\n".join([
        "import sys, tensorflow as tf, tensorflow_text",
        "for path in sys.argv[1:]:",
        "    tf.saved_model.load(path).signatures['serving_default'](text=tf.constant(['open the file']))",
        "print('ok')",
    ])
    proc = subprocess.run([sys.executable, "-c", check, *[str(base / str(v)) for v in versions]], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


WHITESPACE = ["open\nthe file", "close  the\tfile\n", "\n\nsave   the folder\r\n", "delete a file\n%s\n",
              "open the file", "\topen  the\n\nfile %d lines\t"]


def test_edge_translates_like_the_saved_model_on_whitespace(tmp_path, seq2seq, tokenizer, translator_export):
    """The same strings from the SavedModel's serving_default and the edge Generator (tokenizer round trip,
    placeholder protection) on text with newlines, tabs and runs of spaces."""
    import tensorflow as tf

    from tfformer import edge
    from tfformer.data import tokenizers

    assert edge.generator.WHITESPACE_SYMBOLS == tokenizers.ESCAPES  # one mapping on both sides
    _, path = translator_export
    serve = tf.saved_model.load(path).signatures["serving_default"]
    served = [s.decode("utf-8") for s in serve(text=tf.constant(WHITESPACE))["translation"].numpy()]
    decoder = export.tflite_decoder(seq2seq, str(tmp_path / "s2s.tflite"), max_length=16, tokenizer=tokenizer)
    gen = edge.Generator(decoder)
    assert [gen.translate_text(text, max_new_tokens=12) for text in WHITESPACE] == served
    for text in WHITESPACE:
        ids = tokenizer.tokenize([text]).to_list()[0]
        assert gen.tokenize(text) == ids and gen.detokenize(ids) == text  # exact round trip, as in the SavedModel
    with_unknown = [5, 1, 6, 3]
    assert gen.detokenize(with_unknown) == tokenizer.detokenize([with_unknown]).numpy()[0].decode("utf-8")
