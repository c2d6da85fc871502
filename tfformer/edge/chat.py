"""Chat with a `.litertlm` bundle (`tfformer.export.litertlm`) in Google's LiteRT-LM runtime."""

import os

from tfformer.checks import check_int, check_messages


class Chat:
    """A causal LM's `.litertlm` bundle, run by LiteRT-LM's own engine (`litert_lm.Engine`, the `litert-lm-api`
    package: `pip install tfformer[litertlm]`), as an app on a device runs it.

    The engine renders the bundle's chat template, prefills, decodes greedily and stops at the bundle's stop
    tokens: the same reply `CausalLM.chat` gives with its default sampler. It loads once; each `chat` call is a
    conversation of its own, so, like `CausalLM.chat`, the call carries the whole history.

    Args:
        path: the `.litertlm` file.
        num_threads: CPU threads of the engine.
        verbose: bool. `False` (default): the runtime logs errors only. Loading a bundle on a CPU machine otherwise
            writes about 40 lines to stderr: the sections and accelerators it looks for and does not find, the
            ones it registers, and, at exit, the ones it frees. `True`: from its INFO level up. It is LiteRT-LM's
            one level for the whole process (`litert_lm.set_min_log_severity`), set as the engine loads.

    Example:
    ```python
    chat = tfformer.edge.Chat("export/smollm2/model.litertlm")
    chat.chat([{"role": "user", "content": "What is the capital of France?"}])   # '... Paris ...'
    for piece in chat.chat([{"role": "user", "content": "Hi!"}], stream=True):
        print(piece, end="")
    ```
    """

    def __init__(self, path, num_threads=2, verbose=False):
        if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
            raise FileNotFoundError(f"`path` must be a .litertlm file (`tfformer export ... --format litertlm`). "
                                    f"Received: path={path!r}")
        check_int("num_threads", num_threads)
        if not isinstance(verbose, bool):
            raise ValueError(f"`verbose` must be True or False. Received: verbose={verbose!r}")
        try:
            import litert_lm
        except ImportError as error:
            raise ImportError("`tfformer.edge.Chat` runs bundles in LiteRT-LM's runtime: `pip install "
                              "litert-lm-api` (or tfformer[litertlm]).") from error
        self.path = os.fspath(path)
        litert_lm.set_min_log_severity(litert_lm.LogSeverity.INFO if verbose else litert_lm.LogSeverity.ERROR)
        self.engine = litert_lm.Engine(self.path, backend=litert_lm.Backend.CPU(thread_count=num_threads))

    def chat(self, messages, max_new_tokens=256, stream=False):
        """The assistant's reply to `messages` (a list of `{"role": str, "content": str}` ending with a user
        turn). With `stream=True`, a generator of the reply's text pieces as the engine produces them."""
        check_messages(messages)
        if messages[-1]["role"] != "user":
            raise ValueError('`messages` must end with a {"role": "user", ...} turn for the reply to answer. '
                             f"Received a last role of {messages[-1]['role']!r}.")
        check_int("max_new_tokens", max_new_tokens)
        pieces = self._stream(messages, max_new_tokens)
        return pieces if stream else "".join(pieces)

    def _stream(self, messages, max_new_tokens):
        history = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
        with self.engine.create_conversation(messages=history or None) as conversation:
            for chunk in conversation.send_message_async(messages[-1]["content"], max_output_tokens=max_new_tokens):
                for part in chunk.get("content", []):
                    if part.get("type") == "text" and part.get("text"):
                        yield part["text"]

    def close(self):
        """Free the engine (its weights and caches)."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
