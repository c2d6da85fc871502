"""Runs a .litertlm bundle in LiteRT-LM's own runtime (`litert_lm.Engine`), as an app would: no TensorFlow, no tfformer.

usage: litertlm_engine.py BUNDLE REQUEST_JSON OUTPUT_JSON
REQUEST_JSON: {"prompts": [str, ...], "max_new_tokens": int, "messages": [str, ...] (optional, through the chat
template), "turns": [str, ...] (optional, one conversation, each reply at most max_new_tokens)}. OUTPUT_JSON:
{"ids": [the runtime's token ids of each prompt], "texts": [each greedy completion], "replies": [each message's
reply], "turn_replies": [each turn's reply], "modules": [modules loaded]}.
"""

import json
import sys

import litert_lm

path, request_path, out_path = sys.argv[1:4]
request = json.load(open(request_path))
engine = litert_lm.Engine(path, backend=litert_lm.Backend.CPU(thread_count=2))
result = {"ids": [], "texts": [], "replies": [], "turn_replies": []}
for prompt in request.get("prompts", []):
    result["ids"].append(engine.tokenize(prompt))
    with engine.create_session(apply_prompt_template=False, max_output_tokens=request["max_new_tokens"]) as session:
        session.run_prefill([prompt])
        result["texts"].append(session.run_decode().texts[0])
for message in request.get("messages", []):
    with engine.create_conversation() as conversation:
        reply = conversation.send_message(message)
        result["replies"].append("".join(part["text"] for part in reply["content"] if part.get("type") == "text"))
if request.get("turns"):
    with engine.create_conversation() as conversation:
        for turn in request["turns"]:
            chunks = conversation.send_message_async(turn, max_output_tokens=request["max_new_tokens"])
            result["turn_replies"].append("".join(part["text"] for chunk in chunks for part in chunk.get("content", [])
                                                  if part.get("type") == "text"))
result["modules"] = sorted(sys.modules)
json.dump(result, open(out_path, "w"))
