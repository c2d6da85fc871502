"""The CLI end to end on tiny data: bad input, no silent overwrite, resume after SIGKILL."""

import os
import signal
import subprocess
import sys
import time

import pytest

import tfformer_command
from tfformer import cli, generation, models

TINY = ["--set", "hidden_dim=16", "--set", "num_heads=2", "--set", "intermediate_dim=32",
        "--set", "num_encoder_layers=1", "--set", "num_decoder_layers=1", "--batch-size", "8"]


def _tsv(path, n=300):
    words = ["open", "close", "file", "folder", "the", "a", "new", "old", "save", "delete"]
    german = ["öffnen", "schließen", "Datei", "Ordner", "die", "eine", "neue", "alte", "speichern", "löschen"]
    lines = []
    for i in range(n):
        a, b = i % 10, (i * 7 + 3) % 10
        lines.append(f"{words[a]} {words[b]} {i}\t{german[a]} {german[b]} {i}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _cli(*args, timeout=600, newcomer=False):
    """`tfformer ARGS` in a fresh process on CPU; `newcomer`: with the environment a new user has (no
    TF_CPP_MIN_LOG_LEVEL, no CUDA_VISIBLE_DEVICES), so what the command prints is what they would see."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    entry = "tfformer.cli"
    if newcomer:  # and the `tfformer` console script's entry point
        for name in ("TF_CPP_MIN_LOG_LEVEL", "CUDA_VISIBLE_DEVICES"):
            env.pop(name)
        entry = "tfformer_command"
    return subprocess.run([sys.executable, "-m", entry, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _here(capsys, *args):
    """`tfformer ARGS` in this process (`cli.main`, as the tests above call it), its exit code and output as `_cli`
    gives them: the commands after a run's training share this process's TensorFlow instead of importing it again
    each (about 4 s a command). A fresh process's output is what `_cli(..., newcomer=True)` checks."""
    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as exit:  # argparse's errors
        code = exit.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["tfformer", *args], code, out, err)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "translation", "--data", "/nonexistent.tsv", "--out", "{tmp}/r"], "does not exist"),
        (["train", "translation", "--target-language", "xx-none", "--out", "{tmp}/r"], "No gettext catalogs"),
        (["train", "translation", "--preset", "nope", "--data", "{tsv}", "--out", "{tmp}/r"], "Unknown preset"),
        (["train", "translation", "--time-budget", "soon", "--data", "{tsv}", "--out", "{tmp}/r"], "time budget"),
        (["train", "translation", "--data", "{empty}", "--out", "{tmp}/r"], "no source<TAB>target"),
        (["train", "translation", "--data", "{notab}", "--out", "{tmp}/r"], "notab.tsv:1: .*no tab"),
        (["train", "translation", "--set", "bogus=1", "--data", "{tsv}", "--out", "{tmp}/r"], "bogus"),
        (["train", "translation", "--preset", "gpt-mini", "--data", "{tsv}", "--out", "{tmp}/r"],
         "Translation needs a seq2seq preset"),
        (["train", "translation", "--batch-size", "0", "--data", "{tsv}", "--out", "{tmp}/r"], "`batch_size` must"),
        (["train", "translation", "--eval-every", "0", "--data", "{tsv}", "--out", "{tmp}/r"], "`eval_every` must"),
        (["train", "lm", "--set", "batch_size=4", "--text", "{tsv}", "--out", "{tmp}/r"],
         "give batch_size with --batch-size"),
        (["train", "translation", "--set", "data_file=x.tsv", "--out", "{tmp}/r"], "give data_file with --data"),
        (["train", "lm", "--preset", "transformer-tiny", "--text", "{tsv}", "--out", "{tmp}/r"],
         "Language modelling needs a causal_lm preset"),
        (["chat", "--litertlm", "{tmp}/missing.litertlm", "--message", "x"], "must be a .litertlm file"),
        (["export", "gpt-mini", "--format", "tflite", "--version", "3", "--out", "{tmp}/x"],
         "--version is for --format saved_model. Received: --format tflite"),
        (["export", "gpt-mini", "--quantize", "dynamic", "--out", "{tmp}/x"],
         "--quantize is for --format litertlm or tflite. Received: --format saved_model"),
        (["export", "gpt-mini", "--format", "all", "--kv-cache", "static", "--out", "{tmp}/x"], "--kv-cache is for"),
        (["export", "gpt-mini", "--out", "{notab}"], "is not a writable directory \\(it is a file\\)"),
    ],
)
def test_bad_input_gives_one_line_errors(tmp_path, capsys, argv, message):
    (tmp_path / "empty.tsv").write_text("")
    (tmp_path / "notab.tsv").write_text("just one column\n")
    fill = dict(tmp=tmp_path, tsv=_tsv(tmp_path / "ok.tsv", 20), empty=tmp_path / "empty.tsv",
                notab=tmp_path / "notab.tsv")
    assert cli.main([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tfformer: error:") and len(err.splitlines()) == 1
    import re
    assert re.search(message, err), err
    # Refused before anything was written (a run directory, an export's --out): a corrected retry can use them.
    assert sorted(os.listdir(tmp_path)) == ["empty.tsv", "notab.tsv", "ok.tsv"]


def test_tensorflow_log_level_is_the_users_else_quiet_on_a_cpu_machine(tmp_path):
    driver = tmp_path / "version"
    for environ, present, expected in (({}, False, "3"), ({}, True, "2"), ({"TF_CPP_MIN_LOG_LEVEL": "0"}, False, "0")):
        if present:
            driver.write_text("NVRM version: 1")
        tfformer_command.quiet_tensorflow_logs(environ, nvidia_driver=str(driver))
        assert environ["TF_CPP_MIN_LOG_LEVEL"] == expected


def test_export_runs_tensorflow_without_onednn_and_transcribe_with_it_unless_the_user_set_it():
    for argv, environ, expected in ((["export", "smollm2-135m-instruct", "--format", "litertlm"], {}, "0"),
                                    (["export", "run"], {"TF_ENABLE_ONEDNN_OPTS": "1"}, "1"),
                                    (["transcribe", "a.wav", "--format", "srt"], {}, "1"),
                                    (["transcribe", "a.wav"], {"TF_ENABLE_ONEDNN_OPTS": "0"}, "0"),
                                    (["train", "translation"], {}, None), ([], {}, None)):
        tfformer_command.tensorflow_environment(argv, environ)
        assert environ.get("TF_ENABLE_ONEDNN_OPTS") == expected


NOISE = (b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
         b"I0000 00:00:1796449896.764932   13003 port.cc:153] oneDNN custom operations are on. You may see slightly "
         b"different numerical results due to floating-point round-off errors from different computation orders. To "
         b"turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.\n"
         b"I0000 00:00:1796443199.673849   14725 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU "
         b"will not be used.\n")


def test_tensorflow_load_lines_are_dropped_and_every_other_line_kept():
    error = b"E0000 00:00:1796443199.700000   14725 cuda_executor.cc:1] some real error\n"
    assert tfformer_command.without_load_noise(NOISE + error + NOISE + b"last, no newline") == (
        error + b"last, no newline")
    first = NOISE[: NOISE.index(b"\n") + 1]
    assert tfformer_command.without_load_noise(b"x" + NOISE) == b"x" + first  # whole lines only


def test_a_failing_tensorflow_import_keeps_its_error_output(tmp_path):
    """A stand-in `tensorflow` that writes the load noise and an error to file descriptor 2, then fails: the error and
    the traceback reach stderr, the noise does not; with `TF_CPP_MIN_LOG_LEVEL=0` the noise does too."""
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text(
        f"import os\nos.write(2, {NOISE!r} + b'broken library\\n')\nraise ImportError('no tensorflow here')\n")
    script = "import tfformer_command; tfformer_command.import_tensorflow_quietly()"
    for level, noisy in (("3", False), ("0", True)):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
                   TF_CPP_MIN_LOG_LEVEL=level)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60, env=env)
        assert out.returncode == 1
        assert b"broken library\n" in out.stderr and b"ImportError: no tensorflow here" in out.stderr
        assert (b"cudart_stub" in out.stderr) == noisy and (b"InitializeLog" in out.stderr) == noisy
        assert (b"oneDNN custom operations" in out.stderr) == noisy
        assert out.stderr.index(b"broken library") < out.stderr.index(b"Traceback")  # in the order written


def test_tensorflow_loads_when_stderr_is_closed(tmp_path):
    """A process whose file descriptor 2 is closed (a daemon's) has no stderr to filter: TensorFlow (a stand-in
    here) still loads."""
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text("LOADED = True\n")
    script = ("import os, sys; os.close(2); import tfformer_command; tfformer_command.import_tensorflow_quietly(); "
              "print(sys.modules['tensorflow'].LOADED)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert (out.returncode, out.stdout) == (0, "True\n")


def test_exit_collects_the_garbage_once_and_then_freezes_what_is_alive(tmp_path):
    """`collect_once_at_exit`, in a fresh process: a cycle that is garbage at exit is still collected (its finalizer
    writes a file: no data lost; a freeze without that collection would skip it), and then every object still alive
    is frozen, before the exit handlers registered ahead of it run."""
    flushed = tmp_path / "flushed.txt"
    script = f"""
import atexit, gc, sys
import tfformer_command

class Cycle:
    def __init__(self):
        self.me = self
    def __del__(self):
        open({str(flushed)!r}, "w").write("flushed")

atexit.register(lambda: sys.stdout.write(f"frozen {{gc.get_freeze_count()}}\\n"))  # registered first: runs last
tfformer_command.collect_once_at_exit()
alive = [[i] for i in range(1000)]
Cycle()
gc.disable()  # only the exit's collection may find the cycle
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert flushed.read_text() == "flushed"
    assert int(out.stdout.split()[-1]) > 1000  # `alive` and its lists, at least


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert cli.main(["train", "translation", "--data", _tsv(tmp_path / "d.tsv", 20), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "precious.txt").read_text() == "keep me"
    # --overwrite replaces a run only once the command's options are good: a bad one keeps it.
    for argv, message in ((["translation", "--data", str(tmp_path / "d.tsv"), "--replicas", "0"], "`replicas`"),
                          (["lm", "--text", str(tmp_path / "missing.txt")], "does not exist"),
                          (["lm", "--text", str(tmp_path / "d.tsv"), "--set", "bogus=1"], "bogus")):
        assert cli.main(["train", *argv, "--out", str(out), "--overwrite"]) == 2
        assert message in capsys.readouterr().err
        assert (out / "precious.txt").read_text() == "keep me"


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """A tiny translation run killed (SIGKILL) once it wrote a backup, then the same command again, run as a new
    user runs it (`newcomer`): `(run directory, the resumed command's CompletedProcess, the killed process's
    output)`. The resume test checks the resume; the translate/export test goes on from the finished run, so the
    module trains one run, not two."""
    tmp_path = tmp_path_factory.mktemp("cli")
    data = _tsv(tmp_path / "d.tsv")
    out = tmp_path / "run"
    args = ["train", "translation", "--data", data, "--out", str(out), "--time-budget", "45s", "--eval-every", "5",
            *TINY]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen([sys.executable, "-m", "tfformer.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metadata = out / "backup" / "training_metadata.json"
    deadline = time.monotonic() + 240
    while not metadata.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert metadata.exists(), "no backup was written before the deadline"
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)  # mid-epoch, maybe mid-save
    killed_output = proc.communicate()[0]
    assert not (out / "metrics.json").exists()
    return out, _cli(*args, newcomer=True), killed_output


def test_killed_run_resumes_from_its_backup_and_finishes(resumed_run):
    out, resumed, _ = resumed_run
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout
    assert (out / "metrics.json").exists() and (out / "model.keras").exists()
    assert not (out / "backup").exists()  # deleted once training finished


def test_train_translate_export_from_the_command_line(resumed_run, tmp_path, capsys):
    """A whole tiny run through the CLI: train, translate (same strings as the library), export both formats.
    Training is `resumed_run`'s, in fresh processes (its first from scratch, killed; the second as a new user runs
    it); the commands after it run in this process (`_here`)."""
    out, trained, killed_output = resumed_run
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "BLEU on the test split" in trained.stdout
    # No TensorFlow error line on a machine without a GPU, and no Keras warning at the end of an epoch or of an
    # evaluation (the datasets state their length), from scratch or resumed.
    assert "cuInit" not in trained.stderr
    assert "cudart_stub" not in trained.stderr and "InitializeLog" not in trained.stderr  # TensorFlow's load lines
    assert "ran out of data" not in trained.stderr + trained.stdout + killed_output
    translated = _here(capsys, "translate", "--run", str(out), "--max-new-tokens", "8", "open the file 3",
                       "save a folder 9")
    assert translated.returncode == 0, translated.stderr[-3000:]
    from tfformer.recipes import translation

    translator = translation.load_run(str(out))
    # The CLI decodes as the run was evaluated (beam search); `--beam-size 1` is the library's greedy default.
    texts = ["open the file 3", "save a folder 9"]
    expected = translator.translate(texts, max_new_tokens=8, beam_size=translation.BEAM_SIZE,
                                    length_penalty=translation.LENGTH_PENALTY)
    assert translated.stdout.splitlines()[-2:] == expected
    greedy = _here(capsys, "translate", "--run", str(out), "--max-new-tokens", "8", "--beam-size", "1", *texts)
    assert greedy.stdout.splitlines()[-2:] == translator.translate(texts, max_new_tokens=8)
    exported = _here(capsys, "export", str(out), "--format", "all", "--out", str(tmp_path / "models" / "en-de"),
                     "--max-new-tokens", "8")
    assert exported.returncode == 0, exported.stderr[-3000:]
    names = sorted(os.listdir(tmp_path / "models" / "en-de"))
    assert names == ["1", "decoder.tflite", "model.tflite"]
    static = _here(capsys, "export", str(out), "--format", "tflite", "--out", str(tmp_path / "static"),
                   "--batch-size", "1", "--sequence-length", "8")
    assert static.returncode == 0, static.stderr[-3000:]
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_path=str(tmp_path / "static" / "model.tflite")).get_signature_runner("predict_ids")
    assert {name: list(d["shape"]) for name, d in runner.get_input_details().items()} == {
        "encoder_token_ids": [1, 8], "decoder_token_ids": [1, 8]}
    again = _here(capsys, "export", str(out), "--format", "saved_model", "--out",
                  str(tmp_path / "models" / "en-de"), "--version", "1")
    assert again.returncode == 2 and "already exists" in again.stderr
    # Warm-up records at the batch sizes a batching server forms (TF Serving's PredictionLog TFRecord).
    warm = _here(capsys, "export", str(out), "--format", "saved_model", "--out", str(tmp_path / "models" / "en-de"),
                 "--max-new-tokens", "8", "--warmup-batch-sizes", "3")
    assert warm.returncode == 0, warm.stderr[-3000:]
    import tensorflow as tf
    from tensorflow_serving.apis import prediction_log_pb2

    records = tmp_path / "models" / "en-de" / "2" / "assets.extra" / "tf_serving_warmup_requests"
    logs = [prediction_log_pb2.PredictionLog.FromString(record.numpy())
            for record in tf.data.TFRecordDataset(str(records))]
    assert logs and {log.predict_log.request.inputs[next(iter(log.predict_log.request.inputs))]
                     .tensor_shape.dim[0].size for log in logs} == {3}
    bad = _here(capsys, "export", str(out), "--format", "saved_model", "--out", str(tmp_path / "bad"),
                "--warmup-batch-sizes", "0,8")
    assert bad.returncode == 2 and "--warmup-batch-sizes" in bad.stderr and not (tmp_path / "bad").exists()
    blank = _here(capsys, "translate", "--run", str(out), "   ")
    assert blank.returncode == 2 and "whitespace-only" in blank.stderr


def test_generate_and_chat_continue_a_causal_lm_run(tmp_path, capsys):
    """`tfformer generate` streams each prompt's greedy continuation, the library's `generate` (its graph loop), one
    prompt a line; `tfformer chat --run` replies as `CausalLM.chat`; a model that is not a causal LM is refused by
    name, for both commands, and `translate` and `evaluate` refuse the LM run."""
    from tests.export.byte_pair_lm import byte_pair_tokenizer, llama_lm

    tokenizer = byte_pair_tokenizer(ascii_only=True)  # any ids decode to text that compares token for token
    lm = llama_lm(tokenizer.vocabulary_size)
    lm.preprocessor = tokenizer
    run = str(tmp_path / "lm")
    lm.save_to_preset(run)
    prompts = ["open the", "close a folder and"]
    generated = _here(capsys, "generate", "--run", run, "--max-new-tokens", "6", *prompts)
    assert generated.returncode == 0, generated.stderr
    expected = lm.generate(prompts, max_new_tokens=6, jit_compile=False)
    assert all(expected) and generated.stdout == "".join(f"{text}\n" for text in expected)
    with pytest.raises(ValueError, match="`prompt` must be one string: `stream` continues one prompt"):
        lm.stream(prompts)  # checked when called; was "too many values to unpack" at the first piece
    with pytest.raises(ValueError, match="`sampler` must pick one token a step"):
        lm.stream("open the", sampler=generation.BeamSampler(2))  # was NotImplementedError at the first piece
    refused = _here(capsys, "generate", "--run", run, "--max-new-tokens", "6", "open the", " ")
    assert refused.returncode == 2 and refused.stdout == "" and "whitespace-only" in refused.stderr  # no part-output
    chatted = _here(capsys, "chat", "--run", run, "--message", "open the file", "--max-new-tokens", "6")
    assert chatted.returncode == 0, chatted.stderr
    assert chatted.stdout == lm.chat([{"role": "user", "content": "open the file"}], max_new_tokens=6,
                                     jit_compile=False) + "\n"
    for command in (["translate", "--run", run, "x"], ["evaluate", "--run", run]):
        refused = _here(capsys, *command)
        assert refused.returncode == 2 and "holds a CausalLM, not a translator" in refused.stderr, refused.stderr
    encoder = models.build_encoder(models.TransformerConfig(vocabulary_size=16, hidden_dim=8, num_heads=2,
                                                            intermediate_dim=8, num_encoder_layers=1))
    encoder.save_to_preset(str(tmp_path / "encoder"))
    for command in (["generate", "--run", str(tmp_path / "encoder"), "x"],
                    ["chat", "--run", str(tmp_path / "encoder"), "--message", "x"]):
        refused = _here(capsys, *command)
        assert refused.returncode == 2 and f"--run {tmp_path / 'encoder'} is a " in refused.stderr, refused.stderr
        assert "not a causal LM" in refused.stderr
