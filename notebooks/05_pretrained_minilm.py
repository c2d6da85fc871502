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
# # Sentence embeddings and semantic search with all-MiniLM-L6-v2
#
# `all-MiniLM-L6-v2` (sentence-transformers) is a 6-layer, 384-wide BERT encoder trained so that the **mean of its
# token vectors** is a good sentence embedding: sentences that mean the same thing get vectors with a high cosine
# similarity. `tfformer.models.from_preset("all-minilm-l6-v2")` loads its weights into tfformer's own layers
# (`TransformerEncoder` + `SentenceEncoder`: mean pooling over real tokens, then L2 normalisation) with an in-graph
# WordPiece tokenizer. No training here, so quick and full mode are the same.

# %%
# %matplotlib inline
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import json
import time

import numpy as np
from IPython.display import display
from matplotlib.figure import Figure

import tfformer
from tfformer import models

QUICK = os.environ.get("TFFORMER_QUICK") == "1"
t = time.monotonic()
model = models.from_preset("all-minilm-l6-v2")
print(f"loaded in {time.monotonic() - t:.1f}s: {model.count_params():,} parameters")

# %% [markdown]
# ## Embeddings
#
# `encode` tokenizes (lower-cased WordPiece, `[CLS] ... [SEP]`), runs the encoder and pools. The vectors have unit
# length, so the cosine similarity of two sentences is the dot product of their vectors.

# %%
tokens = model.tokenize(["A man is eating food."])
print("token ids:", tokens["token_ids"][0].tolist())
vectors = model.encode(["A man is eating food.", "A man is eating a piece of bread.", "The new movie is so great!"])
print("shape", vectors.shape, "norms", np.linalg.norm(vectors, axis=1).round(6))
print("cosine similarities:\n", models.cosine_similarity(vectors).round(3))

# %% [markdown]
# ## Semantic search
#
# Embed a corpus once; for each query, rank the corpus by cosine similarity. None of the best matches below shares
# many words with its query: "gorilla costume ... drums" finds "A monkey is playing drums."

# %%
corpus = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "A cheetah is running behind its prey.",
    "The new movie is so great!",
    "Permission denied while opening the file.",
    "The server could not find the requested model version.",
]
queries = [
    "A man is eating pasta.",
    "Someone in a gorilla costume is playing a set of drums.",
    "A cheetah chases prey on a field.",
    "Access to the file was refused.",
]
expected = [0, 7, 8, 10]  # the best match of each query, as a person would pick it

corpus_vectors = model.encode(corpus)  # (12, 384)
query_vectors = model.encode(queries)  # (4, 384)
scores = models.cosine_similarity(query_vectors, corpus_vectors)  # (4, 12)
for query, row in zip(queries, scores):
    print(f"\n{query}")
    for index in np.argsort(-row)[:3]:
        print(f"  {row[index]:.4f}  {corpus[index]}")

# %%
fig = Figure(figsize=(11, 4), layout="constrained")
ax = fig.subplots()
image = ax.imshow(scores, cmap="viridis", aspect="auto")
ax.set_xticks(range(len(corpus)), [c[:28] for c in corpus], rotation=60, ha="right", fontsize=8)
ax.set_yticks(range(len(queries)), [q[:40] for q in queries], fontsize=8)
ax.set_xlabel("corpus sentence")
ax.set_ylabel("query")
ax.set_title("cosine similarity, all-MiniLM-L6-v2")
fig.colorbar(image, ax=ax)
display(fig)

# %% [markdown]
# ## Same numbers as sentence-transformers
#
# `tests/fixtures/minilm_reference.npz` holds embeddings computed with the original PyTorch model
# (`tools/make_minilm_fixture.py`). Ours match to float32 round-off.

# %%
fixture = os.path.join(os.path.dirname(tfformer.__file__), os.pardir, "tests", "fixtures", "minilm_reference.npz")
reference_error = None
if os.path.exists(fixture):
    reference = np.load(fixture)
    reference_sentences = json.loads(bytes(reference["sentences_json"]).decode("utf-8"))
    count = 8 if QUICK else len(reference_sentences)
    ours = model.encode(reference_sentences[:count])
    reference_error = float(np.abs(ours - reference["embeddings"][:count]).max())
    print(f"{count} sentences, max |tfformer - sentence-transformers| = {reference_error:.2e}")
else:
    print("reference fixture not found (tfformer installed without its tests); skipped")

# %% [markdown]
# ## Check: what this notebook teaches

# %%
assert vectors.shape == (3, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
assert scores.argmax(axis=1).tolist() == expected, scores.argmax(axis=1)
assert models.cosine_similarity(vectors)[0, 1] > models.cosine_similarity(vectors)[0, 2]
if reference_error is not None:
    assert reference_error < 1e-5
print("all checks passed")
