"""Greedy decoding on device: the host loop around the `decode_step` signature of a tfformer .tflite file."""

import numpy as np

UNK_ID, START_ID, END_ID = 1, 2, 3
UNK_TEXT = " \u2047 "  # how SentencePiece writes the unknown piece
# The whitespace SentencePiece would fold and the symbols tfformer.data.SubwordTokenizer maps it to.
WHITESPACE_SYMBOLS = (("\t", "\u2409"), ("\n", "\u240a"), ("\r", "\u240d"))


class Generator:
    """Runs a decoder written by `tfformer.export.tflite_decoder` with `ai_edge_litert`.

    Args:
        path: the .tflite file.
        num_threads: interpreter threads.

    Example:
    ```python
    gen = tfformer.edge.Generator("gpt.tflite")
    gen.generate([5, 17, 9], max_new_tokens=20)      # causal LM: prompt ids -> new ids
    gen.translate([12, 40, 7], max_new_tokens=20)    # seq2seq: source ids -> target ids
    ```
    """

    def __init__(self, path, num_threads=2):
        from ai_edge_litert.interpreter import Interpreter, InterpreterWithCustomOps

        self.interpreter = Interpreter(model_path=path, num_threads=num_threads)
        signatures = self.interpreter.get_signature_list()
        if "tokenize" in signatures:
            import tensorflow_text as tf_text  # the file carries TF-Text tokenizer ops (custom ops)

            self.interpreter = InterpreterWithCustomOps(
                model_path=path, num_threads=num_threads, custom_op_registerers=tf_text.tflite_registrar.SELECT_TFTEXT_OPS
            )
        if "decode_step" not in signatures:
            raise ValueError(f"{path} has no decode_step signature (found {sorted(signatures)}); "
                             "write it with tfformer.export.tflite_decoder.")
        self.signatures = signatures
        self._step = self.interpreter.get_signature_runner("decode_step")
        details = self._step.get_input_details()
        self.cache_shape = tuple(details["cache"]["shape"])
        self.max_length = self.cache_shape[4]
        self.is_seq2seq = "encode" in signatures
        if self.is_seq2seq:
            self._encode = self.interpreter.get_signature_runner("encode")
            self.source_length = int(self._encode.get_input_details()["encoder_token_ids"]["shape"][1])

    def _check(self, ids, max_new_tokens, limit, what):
        if max_new_tokens <= 0:
            raise ValueError(f"`max_new_tokens` must be positive. Received: max_new_tokens={max_new_tokens}")
        if not len(ids):
            raise ValueError(f"The {what} is empty.")
        if len(ids) > limit:
            raise ValueError(f"The {what} has {len(ids)} tokens; this file holds at most {limit}.")

    def generate(self, prompt_ids, max_new_tokens=32):
        """Causal LM: greedy continuation ids of `prompt_ids` (stops after the end token)."""
        self._check(prompt_ids, max_new_tokens, self.max_length - 1, "prompt")
        cache = np.zeros(self.cache_shape, np.float32)
        new, logits = [], None
        for index, token in enumerate(prompt_ids):  # prefill, one token per call (fixed shapes)
            out = self._step(token_ids=np.array([[token]], np.int32), cache=cache, index=np.array(index, np.int32))
            logits, cache = out["logits"], out["cache"]
        index = len(prompt_ids)
        while len(new) < max_new_tokens and index < self.max_length:
            token = int(np.argmax(logits[0, -1]))
            new.append(token)
            if token == END_ID or index + 1 >= self.max_length:
                break
            out = self._step(token_ids=np.array([[token]], np.int32), cache=cache, index=np.array(index, np.int32))
            logits, cache = out["logits"], out["cache"]
            index += 1
        return new

    def translate(self, source_ids, max_new_tokens=32):
        """Seq2seq: greedy target ids for `source_ids` (stops after the end token)."""
        self._check(source_ids, max_new_tokens, self.source_length, "source")
        src = np.zeros((1, self.source_length), np.int32)
        src[0, : len(source_ids)] = source_ids
        encoded = self._encode(encoder_token_ids=src)
        cache = np.zeros(self.cache_shape, np.float32)
        token, new = START_ID, []
        for index in range(min(max_new_tokens, self.max_length)):
            out = self._step(token_ids=np.array([[token]], np.int32), cache=cache, index=np.array(index, np.int32),
                             cross_cache=encoded["cross_cache"], encoder_padding_mask=encoded["encoder_padding_mask"])
            cache = out["cache"]
            token = int(np.argmax(out["logits"][0, -1]))
            new.append(token)
            if token == END_ID:
                break
        return new

    def tokenize(self, text):
        """Ids of `text`, as the SavedModel's tokenizer gives them: tab, newline and carriage return are mapped to
        the tokenizer's reserved symbols here (the file's tokenizer has no regex ops to do it)."""
        if "tokenize" not in self.signatures:
            raise ValueError("This file has no tokenize signature; export it with tokenizer=.")
        for raw, symbol in WHITESPACE_SYMBOLS:
            text = text.replace(raw, symbol)
        ids = self.interpreter.get_signature_runner("tokenize")(text=np.array([text.encode("utf-8")]))["token_ids"][0]
        return [int(t) for t in ids if t != 0]

    def detokenize(self, ids):
        """Text of `ids` (padding, start and end ids dropped), as the SavedModel's tokenizer writes it: the unknown
        id as " ⁇ " (the file's detokenizer drops it) and the reserved symbols back to tab, newline, return."""
        if "detokenize" not in self.signatures:
            raise ValueError("This file has no detokenize signature; export it with tokenizer=.")
        runner = self.interpreter.get_signature_runner("detokenize")
        ids = [int(t) for t in ids if t > END_ID or t == UNK_ID]
        pieces, segment = [], []
        for token in ids + [None]:
            if token is None or token == UNK_ID:
                if segment:
                    pieces.append(runner(token_ids=np.array([segment], np.int32))["text"][0].decode("utf-8"))
                if token == UNK_ID:
                    pieces.append(UNK_TEXT)
                segment = []
            else:
                segment.append(token)
        text = "".join(pieces)
        for raw, symbol in WHITESPACE_SYMBOLS:
            text = text.replace(symbol, raw)
        return text

    def translate_text(self, text, max_new_tokens=32):
        """Seq2seq, text in and out with the same placeholder protection as the SavedModel's `serving_default`
        (`tfformer.data.placeholders`): every placeholder and the edge whitespace of `text` are in the result."""
        from tfformer.data import placeholders

        masked = placeholders.mask(text)
        if not masked.translatable:
            return text
        source = self.tokenize(masked.text)[: self.source_length]  # the SavedModel truncates sources alike
        new = self.translate(source, max_new_tokens=max_new_tokens) if source else []
        new = new[: new.index(END_ID)] if END_ID in new else new
        return placeholders.restore(masked, self.detokenize(new))
