# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # English → German with `model.fit`
#
# The encoder–decoder Transformer of the paper, trained on the English→German pairs that every Linux machine
# already has: the gettext translation catalogs under `/usr/share/locale/de` (program messages such as
# "No such file or directory" → "Datei oder Verzeichnis nicht gefunden").
#
# Training is plain `model.fit` under `tf.distribute.MirroredStrategy` over **two logical CPU replicas**
# (the same code runs data-parallel on two GPUs), with a TensorBoard callback. Then: loss and accuracy
# curves, BLEU on held-out pairs, and the cross-attention of a translated sentence.
#
# `TFFORMER_QUICK=1` trains a tiny model for a few steps (the checks still hold, the translations are junk);
# without it, a half-size `transformer-tiny` trains for 8 minutes on 2 CPU cores.

# %%
# The strategy comes first: it splits the CPU into two logical devices, which TensorFlow only allows
# before it creates its first tensor.
# %matplotlib inline
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from tfformer import training

strategy = training.get_strategy(replicas=2)
print("replicas in sync:", strategy.num_replicas_in_sync)

# %%
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from IPython.display import display  # noqa: E402

from tfformer import data, generation, models, viz  # noqa: E402
from tfformer.models import base  # noqa: E402

QUICK = os.environ.get("TFFORMER_QUICK") == "1"
if QUICK:
    SETTINGS = dict(train_pairs=1500, test_pairs=32, vocabulary_size=600, max_length=24, batch_size=32,
                    epochs=2, steps_per_epoch=8, validation_steps=2, time_budget="2m",
                    model=dict(hidden_dim=32, num_heads=2, intermediate_dim=64, num_encoder_layers=1,
                               num_decoder_layers=1))
else:
    # transformer-tiny (d=128, 2+2): small enough to take thousands of steps in minutes on 2 CPU cores.
    SETTINGS = dict(train_pairs=None, test_pairs=300, vocabulary_size=4000, max_length=24, batch_size=64,
                    epochs=40, steps_per_epoch=200, validation_steps=10, time_budget="8m",
                    model=dict(hidden_dim=128, num_heads=4, intermediate_dim=512, num_encoder_layers=2,
                               num_decoder_layers=2))
BLEU_THRESHOLD = 12.0  # the full run must beat this on the held-out pairs (measured: 18.0 after 8 CPU minutes)
keras.utils.set_random_seed(0)
SETTINGS

# %% [markdown]
# ## Data: gettext catalogs
#
# `gettext_pairs` reads every `.mo` catalog and splits the pairs by a stable hash of the English source into
# train / validation / test, so a sentence never appears in two splits.

# %%
splits = data.gettext_pairs("de")
print({name: len(pairs) for name, pairs in splits.items()})
for source, target in splits["test"][:5]:
    print(f"  {source!r} -> {target!r}")

# %% [markdown]
# A subword vocabulary (SentencePiece unigram) is learned on both languages together, so the embedding
# matrix is shared by encoder, decoder and output layer (the paper's three-way weight tying).

# %%
train_pairs = splits["train"][: SETTINGS["train_pairs"]]
t = time.monotonic()
tokenizer = data.SubwordTokenizer.train([s for pair in train_pairs for s in pair], SETTINGS["vocabulary_size"])
print(f"{tokenizer.vocabulary_size} pieces in {time.monotonic() - t:.1f}s")


def pieces(ids):
    """The text of each id on its own (special ids 0-3 print as <id>)."""
    ids = [int(i) for i in ids]
    if not ids:
        return []
    texts = tokenizer.detokenize(tf.ragged.constant([[i] for i in ids], dtype=tf.int32)).numpy()
    return [text.decode() if i > data.END_ID else f"<{i}>" for i, text in zip(ids, texts)]


for text in ["Permission denied", "Zugriff verweigert"]:
    print(text, "->", pieces(tokenizer.tokenize([text])[0].numpy()))


# %%
def fits(pairs, max_length):
    """Pairs whose source and target (plus the end token) fit in `max_length` tokens."""
    src = tokenizer.tokenize([s for s, _ in pairs]).row_lengths().numpy()
    tgt = tokenizer.tokenize([t for _, t in pairs]).row_lengths().numpy()
    return [p for p, a, b in zip(pairs, src, tgt) if a <= max_length and b + 1 <= max_length]


max_length = SETTINGS["max_length"]
train_pairs = fits(train_pairs, max_length)
validation_pairs = fits(splits["validation"], max_length)
test_pairs = fits(splits["test"], max_length)[: SETTINGS["test_pairs"]]
print(f"train {len(train_pairs)}, validation {len(validation_pairs)}, test {len(test_pairs)}")

batch_size = SETTINGS["batch_size"]
train_ds = data.make_translation_dataset(train_pairs, tokenizer, batch_size, max_length, seed=0).repeat()
validation_ds = data.make_translation_dataset(validation_pairs, tokenizer, batch_size, max_length, shuffle=False)
inputs, labels = next(iter(train_ds))
print({k: tuple(v.shape) for k, v in inputs.items()}, "labels", tuple(labels.shape))
print("decoder input:", inputs["decoder_token_ids"][0, :8].numpy(), " labels:", labels[0, :8].numpy(),
      "(shifted by one: teacher forcing)")

# %% [markdown]
# ## Model and `model.fit` under `MirroredStrategy`
#
# Variables are created inside `strategy.scope()`, so each replica holds a mirror; every batch is split in
# two, each half runs on its own logical device, and the gradients are all-reduced before the update.
# The optimizer is AdamW with the paper's warm-up schedule
# $lr = d^{-0.5}\min(step^{-0.5}, step\cdot warmup^{-1.5})$; the loss is label-smoothed cross-entropy that
# ignores padding.

# %%
config = models.get_preset("transformer-tiny", vocabulary_size=tokenizer.vocabulary_size,
                           max_sequence_length=64, **SETTINGS["model"])
with strategy.scope():
    model = models.build_model(config)
    model.compile(
        optimizer=training.transformer_optimizer(config.hidden_dim, warmup_steps=100 if QUICK else 500, clipnorm=1.0),
        loss=training.MaskedSparseCrossEntropy(label_smoothing=0.1),
        metrics=[training.MaskedAccuracy(), training.Perplexity()],
    )
print(f"{model.count_params():,} parameters; "
      f"{config.num_encoder_layers}+{config.num_decoder_layers} layers, d_model={config.hidden_dim}")

# %%
log_dir = os.environ.get("TFFORMER_LOG_DIR") or tempfile.mkdtemp(prefix="tfformer-02-")
callbacks = [
    keras.callbacks.TensorBoard(log_dir=log_dir, update_freq=10),
    training.TimeBudget(SETTINGS["time_budget"]),
]
t = time.monotonic()
history = model.fit(
    train_ds,
    validation_data=validation_ds,
    validation_steps=SETTINGS["validation_steps"],
    epochs=SETTINGS["epochs"],
    steps_per_epoch=SETTINGS["steps_per_epoch"],
    callbacks=callbacks,
    verbose=2,
)
train_seconds = time.monotonic() - t
print(f"trained {len(history.history['loss'])} epochs in {train_seconds:.0f}s; "
      f"TensorBoard: tensorboard --logdir {log_dir}")

# %%
display(viz.plot_history(history, title="English→German"))

# %% [markdown]
# ## Translation and BLEU
#
# The model is a task: give it its tokenizer as `preprocessor` and `translate` takes strings. Greedy decoding runs in
# the graph with a per-layer key/value cache; placeholders (`%s`, tags, edge whitespace) are protected. BLEU is
# sacreBLEU's corpus BLEU on the held-out test pairs.

# %%
model.preprocessor = tokenizer
t = time.monotonic()
hypotheses = model.translate([s for s, _ in test_pairs], max_new_tokens=max_length)
bleu = training.corpus_bleu(hypotheses, [t for _, t in test_pairs])
print(f"BLEU {bleu:.2f} on {len(test_pairs)} test pairs ({time.monotonic() - t:.0f}s)")
for (source, reference), hypothesis in list(zip(test_pairs, hypotheses))[:8]:
    print(f"EN  {source!r}\nREF {reference!r}\nOUT {hypothesis!r}\n")

# %% [markdown]
# ## Cross-attention of one translated sentence
#
# We run the decoder once more over `[START] + translation` (teacher forcing on the model's own output), block by
# block, asking each `DecoderBlock` for its cross-attention weights with `return_attention_scores=True`. Each
# row shows which English pieces the decoder looked at while producing a German piece.

# %%
sentence = "Could not open file"
source_ids = tokenizer.tokenize([sentence]).to_tensor()  # (1, S)
# jit_compile=False: the same graph ops as the full pass below, so the comparison in the last cell is exact.
new_ids = model.generate(source_ids, max_new_tokens=max_length, jit_compile=False)  # ids in, ids out: (1, max_length)
translation_ids = generation.strip_after_end(new_ids)[0]
decoder_ids = tf.constant([[data.START_ID] + translation_ids], tf.int32)  # (1, T)

encoder_outputs, encoder_mask = model.encode(source_ids)
y = base.embed_tokens(model.decoder_token_embedding, model.decoder_position, decoder_ids)
cross_attention = []
for block in model.decoder_blocks:
    y, weights = block(y, encoder_outputs, encoder_padding_mask=encoder_mask, return_attention_scores=True)
    cross_attention.append(weights.numpy())  # (1, N, T, S)
if model.decoder_norm:
    y = model.decoder_norm(y)
logits = model.token_embedding(y, reverse=True)  # (1, T, V)

source_pieces = pieces(source_ids[0].numpy())
target_pieces = ["<start>"] + pieces(translation_ids)
print(sentence, "->", model.translate(sentence, max_new_tokens=max_length))
display(viz.plot_attention(cross_attention[-1], source_pieces, target_pieces,
                           title=f"cross-attention, last decoder block: {sentence!r}"))

# %% [markdown]
# ## Check: what this notebook teaches

# %%
loss = history.history["loss"]
assert strategy.num_replicas_in_sync == 2
assert loss[-1] < loss[0], f"training did not reduce the loss: {loss}"
assert any(name.startswith("events") for _, _, files in os.walk(log_dir) for name in files), "no TensorBoard events"
# The decoder re-run over its own greedy output picks the same tokens: cached decoding == full forward pass.
predicted = np.argmax(logits[0], axis=-1).tolist()  # the full pass's choice after each prefix
assert predicted[: len(translation_ids)] == translation_ids, "cached decoding != full forward pass"
assert len(translation_ids) == max_length or predicted[len(translation_ids)] == data.END_ID
for weights in cross_attention:
    assert np.allclose(weights.sum(-1), 1.0, atol=1e-5), "cross-attention rows are distributions over the source"
assert 0.0 <= bleu <= 100.0
if not QUICK:
    assert bleu > BLEU_THRESHOLD, f"BLEU {bleu:.2f} <= {BLEU_THRESHOLD}"
if QUICK and not os.environ.get("TFFORMER_LOG_DIR"):
    shutil.rmtree(log_dir, ignore_errors=True)  # a quick run's logs are not worth keeping
print(f"all checks passed (BLEU {bleu:.2f}{'' if QUICK else f' > {BLEU_THRESHOLD}'})")
