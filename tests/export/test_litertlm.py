"""`export.litertlm`: bundles that Google's LiteRT-LM runtime runs, checked in that runtime against tfformer itself."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tfformer import export, models

from tests.export.byte_pair_lm import byte_pair_tokenizer, llama_lm
from tests.export.conftest import CFG

pytest.importorskip("litert_lm")
pytest.importorskip("litert_lm_builder")

ENGINE = os.path.join(os.path.dirname(__file__), "litertlm_engine.py")
# Short prompts (prefill_4), one that takes prefill_16, and one that fills a context of 60 slots (58 prompt tokens
# + 2 new) in chunks, the last ones from position 48, where a prefill_16 would not fit.
PROMPTS = ["open the file", "close a folder and open the file", "the file\nthe folder\n" * 3,
           " open" * 53 + " the file the folder and"]


def run_engine(bundle, tmp_path, **request):
    """The bundle in `litert_lm.Engine`, in a process that imports neither TensorFlow nor tfformer."""
    request_path, out_path = tmp_path / "request.json", tmp_path / "out.json"
    request_path.write_text(json.dumps(request))
    subprocess.run([sys.executable, ENGINE, str(bundle), str(request_path), str(out_path)], check=True, timeout=600,
                   env=dict(os.environ, PYTHONPATH=""))
    result = json.loads(out_path.read_text())
    loaded = set(result["modules"])
    assert not {"tensorflow", "tfformer", "keras"} & loaded, sorted({"tensorflow", "tfformer", "keras"} & loaded)
    return result


@pytest.fixture(scope="module")
def lm():
    """A tiny Llama-style LM (grouped-query caches, rotary positions, tied embedding) with random weights and an
    ASCII byte-level BPE, so that any token sequence is text that compares token for token."""
    tokenizer = byte_pair_tokenizer(ascii_only=True)
    model = llama_lm(tokenizer.vocabulary_size)
    model.preprocessor = tokenizer
    return model


def greedy_text(lm, prompt, max_new_tokens):
    """tfformer's own greedy continuation of `prompt` (its graph-mode decode loop), up to its first end id."""
    new = np.asarray(lm.generate(lm.tokenize([prompt]), max_new_tokens=max_new_tokens, jit_compile=False))[0]
    new = new.tolist()
    cut = min([new.index(i) for i in lm.end_ids if i in new] + [len(new)])
    return lm.preprocessor.detokenize(np.array(new[:cut], np.int32)).numpy().decode("utf-8")


def test_float32_bundle_greedy_equals_tfformer(tmp_path, lm):
    bundle = export.litertlm(lm, str(tmp_path / "model.litertlm"), context_length=60, prefill_lengths=(4, 16))
    steps = 2
    result = run_engine(bundle, tmp_path, prompts=PROMPTS, max_new_tokens=steps)
    for prompt, ids, text in zip(PROMPTS, result["ids"], result["texts"]):
        assert ids == np.asarray(lm.tokenize([prompt]))[0].tolist()  # the tokenizer.json's ids are ours
        assert text == greedy_text(lm, prompt, steps), prompt
    assert len(result["ids"][-1]) + steps == 60  # the last prompt fills the context


def test_bad_arguments_name_the_argument(tmp_path, lm):
    path = str(tmp_path / "x.litertlm")
    encoder = models.build_model(models.TransformerConfig(architecture="encoder", vocabulary_size=50, **CFG))
    with pytest.raises(ValueError, match="`task` must be a tfformer CausalLM"):
        export.litertlm(encoder, path)
    with pytest.raises(ValueError, match="`quantize` must be one of"):
        export.litertlm(lm, path, quantize="int2")
    with pytest.raises(ValueError, match=r"`context_length` must be an integer in \[1, max_sequence_length=64\]"):
        export.litertlm(lm, path, context_length=65)
    with pytest.raises(ValueError, match="prefill_lengths"):
        export.litertlm(lm, path, prefill_lengths=(0,))
    assert not os.path.exists(path)


def test_export_command_writes_a_bundle(tmp_path, lm, monkeypatch, capsys):
    """`tfformer export RUN --format litertlm`: the bundle at OUT/model.litertlm, --max-length as its context length,
    --quantize checked against the format before the model loads (exit 2)."""
    from litert_lm_builder import litertlm_peek

    from tfformer import cli

    monkeypatch.setattr(models, "from_preset", lambda name: lm)
    out = tmp_path / "bundle"
    assert cli.main(["export", "tiny", "--format", "litertlm", "--out", str(out), "--max-length", "32"]) == 0
    assert f"LiteRT-LM: {out / 'model.litertlm'}" in capsys.readouterr().out
    listing = io.StringIO()
    litertlm_peek.peek_litertlm_file(str(out / "model.litertlm"), None, output_stream=listing)
    listing = listing.getvalue()
    assert "max_num_tokens: 32" in listing and "HF_Tokenizer_Zlib" in listing and "tf_lite_prefill_decode" in listing
    assert "jinja_prompt_template" in listing and "<|im_start|>assistant" in listing  # the preset's chat template
    for format_, quantize in (("litertlm", "gguf"), ("tflite", "int4")):
        assert cli.main(["export", "tiny", "--format", format_, "--out", str(tmp_path / "x"), "--quantize",
                         quantize]) == 2
        assert f"--quantize {quantize} is not for --format {format_}" in capsys.readouterr().err
    assert cli.main(["export", "tiny", "--format", "litertlm", "--out", str(tmp_path / "x"), "--max-length",
                     "65"]) == 2
    assert "`context_length` must be an integer in [1, max_sequence_length=64]" in capsys.readouterr().err
