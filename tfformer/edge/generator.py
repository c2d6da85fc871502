"""Decoding on device: the host loop (greedy, or beam search for seq2seq) around the `decode_step` signature of a
tfformer .tflite file, run by LiteRT's `CompiledModel` with the caches kept in the runtime's buffers."""

import numpy as np

from tfformer.checks import check_int, check_number
from tfformer.edge.compiled import Signature, compiled_model, next_logits, zero_caches
from tfformer.tokens import END_ID, PAD_ID, START_ID, UNK_ID, cut_at_end

BEAM_NEG = -1e9  # the score of an impossible beam, as tfformer.generation.beam
UNK_TEXT = " \u2047 "  # how SentencePiece writes the unknown piece
# The whitespace SentencePiece would fold and the symbols tfformer.data.SubwordTokenizer maps it to.
WHITESPACE_SYMBOLS = (("\t", "\u2409"), ("\n", "\u240a"), ("\r", "\u240d"))


class Generator:
    """Runs a decoder written by `tfformer.export.tflite_decoder` with `ai_edge_litert`.

    The file's signatures run in LiteRT's `CompiledModel` (XNNPACK on CPU), each input and output a buffer that
    stays bound: each layer's cache keys and values are one buffer that `decode_step` reads and writes (its input
    and output of the same name), so a step writes only its own slot and the host never copies a cache, and a
    seq2seq file's `encode` writes the cross-attention keys and values where `decode_step` reads them. Per step only
    the token, the index and the logits cross between the host and the runtime. The `tokenize` / `detokenize`
    signatures (TF-Text ops) run in an `Interpreter` made on first use (`interpreter`).

    Args:
        path: the .tflite file.
        num_threads: CPU threads of the runtime.
        tokenizer: optional host-side tokenizer for `generate_text`, for files without tokenizer signatures
            (a byte-level BPE's ops are not TFLite ops): an object with `tokenize(str) -> ids` and
            `detokenize(ids) -> str` (tensors of them are fine), e.g. a `tfformer.data.BytePairTokenizer`. Its
            `end_ids` (if any) end a completion, and so does the padding id 0; without them, END_ID does.

    Example:
    ```python
    gen = tfformer.edge.Generator("gpt.tflite")
    gen.generate([5, 17, 9], max_new_tokens=20)      # causal LM: prompt ids -> new ids
    gen.translate([12, 40, 7], max_new_tokens=20)    # seq2seq: source ids -> target ids
    gen.translate_text("File not found\n", max_new_tokens=64, beam_size=4)  # text, as the SavedModel translates
    gen = tfformer.edge.Generator("smollm2.tflite", tokenizer=tfformer.data.BytePairTokenizer.from_gguf(path))
    gen.generate_text("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", max_new_tokens=20)
    ```
    """

    def __init__(self, path, num_threads=2, tokenizer=None):
        if tokenizer is not None and not (callable(getattr(tokenizer, "tokenize", None))
                                          and callable(getattr(tokenizer, "detokenize", None))):
            raise ValueError("`tokenizer` must have `tokenize(text)` and `detokenize(ids)` (e.g. a BytePairTokenizer). "
                             f"Received: tokenizer={tokenizer!r}")
        check_int("num_threads", num_threads, numpy=True)
        self.tokenizer = tokenizer
        ids = [int(i) for i in getattr(tokenizer, "end_ids", None) or []]
        # Id 0 is padding to a tfformer model: never a token to continue from (SmolLM2's <|endoftext|>).
        self.end_ids = ids + [PAD_ID] if ids else [END_ID]
        self.path, self.num_threads = path, num_threads
        self.model = compiled_model(path, num_threads)
        signatures = self.model.get_signature_list()
        if "decode_step" not in signatures:
            raise ValueError(f"`path` must be a decoder file with a decode_step signature, written by "
                             f"tfformer.export.tflite_decoder. Received: path={path!r} with {sorted(signatures)}")
        if "input_features" in signatures.get("encode", {}).get("inputs", []):
            raise ValueError(f"`path` is a Whisper (speech) decoder file: run it with tfformer.edge.Transcriber. "
                             f"Received: path={path!r}")
        self.signatures = signatures
        if "cache_keys_0" not in signatures["decode_step"]["inputs"]:
            raise ValueError(f"`path` is a decoder file of an older layout (one stacked `cache`; now per-layer "
                             f"`cache_keys_i` / `cache_values_i`): write it again with tfformer.export.tflite_decoder. "
                             f"Received: path={path!r}")
        self.is_seq2seq = "encode" in signatures
        if self.is_seq2seq:
            self._encode = Signature(self.model, "encode")
            # The cross-attention keys/values and the padding mask stay in encode's output buffers.
            self._step = Signature(self.model, "decode_step", inputs=self._encode.outputs)
            self.source_length = self._encode.specs["encoder_token_ids"][0][1]
        else:
            self._step = Signature(self.model, "decode_step")
        self.cache_names = sorted(name for name in self._step.inputs if name.startswith("cache_"))
        self.max_length = self._step.specs["cache_keys_0"][0][1]  # each cache (K, S, H)
        self.vocabulary_size = self._step.specs["logits"][0][-1]
        self._caches = {name: self._step.inputs[name] for name in self.cache_names}
        self._beam_caches = [self._caches]  # beam search's caches, made when first needed
        self._interpreter = None

    @property
    def interpreter(self):
        """The file in an `ai_edge_litert` Interpreter (with the TF-Text ops when it has a tokenizer), made on first
        use: it runs `tokenize` and `detokenize`."""
        if self._interpreter is None:
            from ai_edge_litert.interpreter import Interpreter, InterpreterWithCustomOps

            if "tokenize" in self.signatures:
                import tensorflow_text as tf_text  # the file carries TF-Text tokenizer ops (custom ops)

                self._interpreter = InterpreterWithCustomOps(
                    model_path=self.path, num_threads=self.num_threads,
                    custom_op_registerers=tf_text.tflite_registrar.SELECT_TFTEXT_OPS)
            else:
                self._interpreter = Interpreter(model_path=self.path, num_threads=self.num_threads)
        return self._interpreter

    def _check(self, ids, limit, what, max_new_tokens=None):
        if max_new_tokens is not None:
            check_int("max_new_tokens", max_new_tokens, numpy=True)
        array = np.asarray(ids)
        if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
            raise ValueError(f"{what} must be one sequence of integer token ids, shape (n,). Received: shape "
                             f"{array.shape}, dtype {array.dtype}")
        if not len(ids):
            raise ValueError(f"{what} is empty.")
        if len(ids) > limit:
            raise ValueError(f"{what} has {len(ids)} tokens; this file holds at most {limit}.")
        bad = [int(t) for t in ids if not 0 <= int(t) < self.vocabulary_size]
        if bad:
            raise ValueError(f"{what} holds ids outside [0, {self.vocabulary_size}): {bad[:5]}")

    def generate(self, prompt_ids, max_new_tokens=32, end_ids=None):
        """Causal LM: greedy continuation ids of `prompt_ids`, ending with the first of `end_ids` if one is chosen.

        `end_ids`: the ids that stop generation (included in the result); defaults to `self.end_ids`, `()` never
        stops. The prompt and the new tokens must fit the file's cache (`max_length` positions).
        """
        if self.is_seq2seq:
            raise ValueError(f"`generate` continues a causal LM's prompt; {self.path} is a seq2seq (translator) file: "
                             "use `translate`.")
        self._check(prompt_ids, self.max_length - 1, "`prompt_ids`", max_new_tokens)
        if len(prompt_ids) + max_new_tokens > self.max_length:
            raise ValueError(f"`max_new_tokens`={max_new_tokens} after a prompt of {len(prompt_ids)} tokens overflows "
                             f"this file's cache of {self.max_length} positions; ask for at most "
                             f"{self.max_length - len(prompt_ids)}.")
        end_ids = set(self.end_ids if end_ids is None else (int(i) for i in end_ids))
        self._start(self._caches)
        new = []
        for index, token in enumerate(prompt_ids):  # prefill, one token per call (fixed shapes)
            logits = self._decode(token, index)
        index = len(prompt_ids)
        while True:
            token = int(np.argmax(logits))
            new.append(token)
            if token in end_ids or len(new) == max_new_tokens:
                return new
            logits = self._decode(token, index)
            index += 1

    def _start(self, caches):
        """Steps read and update `caches` (`{name: buffer}` of `decode_step`'s caches), from zeros."""
        self._bind(caches)
        zero_caches(self._step, caches)

    def _bind(self, caches):
        for name, buffer in caches.items():
            self._step.bind(name, buffer)

    def _decode(self, token, index):
        """One decoder step on the bound caches (written in the runtime's buffers): the next token's logits `(V,)`."""
        return next_logits(self._step, token, index)

    def next_logits(self, ids, source_ids=None):
        """The logits `(V,)` of the token after `ids`, fed one per step from empty caches: for a seq2seq file after
        encoding `source_ids` (`ids` are the decoder's inputs: `START_ID` and the target so far), for a causal LM
        `ids` are the prompt and more.
        What a greedy or beam step chose among (e.g. to see by how much two decoders' choices differ)."""
        if self.is_seq2seq != (source_ids is not None):
            raise ValueError(f"`source_ids` is required for a seq2seq file and refused for a causal LM's. Received: "
                             f"source_ids={source_ids!r} for a {'seq2seq' if self.is_seq2seq else 'causal LM'} file")
        self._check(ids, self.max_length, "`ids`")
        if self.is_seq2seq:
            self._check(source_ids, self.source_length, "`source_ids`")
            src = np.zeros((1, self.source_length), np.int32)
            src[0, : len(source_ids)] = source_ids
            self._encode(encoder_token_ids=src)
        self._start(self._caches)
        for index, token in enumerate(ids):
            logits = self._decode(int(token), index)
        return logits

    def generate_text(self, text, max_new_tokens=32):
        """Causal LM, text in and out with the host `tokenizer`: the greedy completion of `text`, up to (without)
        the first end id. A chat prompt is `tokenizer.apply_chat_template(messages)`."""
        if self.tokenizer is None:
            raise ValueError("`generate_text` needs the host tokenizer: pass `tokenizer=` to Generator.")
        if not isinstance(text, str) or not text:
            raise ValueError(f"`text` must be a non-empty str. Received: text={text!r:.80}")
        ids = [int(t) for t in np.asarray(self.tokenizer.tokenize(text)).reshape(-1) if int(t) != PAD_ID]
        new = self.generate(ids, max_new_tokens=max_new_tokens)
        if new and new[-1] in self.end_ids:
            new = new[:-1]
        if not new:
            return ""
        return _as_str(self.tokenizer.detokenize(np.array(new, np.int32)))

    def translate(self, source_ids, max_new_tokens=None, beam_size=None, length_penalty=0.6):
        """Seq2seq: target ids for `source_ids` (ending with the end token if one is chosen), greedy or, with a
        `beam_size`, by beam search with the GNMT `length_penalty`: the choices of the SavedModel's
        `serving_default` exported with the same `beam_size` (`tfformer.generation.BeamSampler`). At most
        `max_new_tokens`, by default the file's decoder length (`max_length`), as the Keras model's `translate`
        defaults to its own."""
        if not self.is_seq2seq:
            raise ValueError(f"`translate` needs a seq2seq (translator) file; {self.path} is a causal LM's: use "
                             "`generate`.")
        max_new_tokens = self.max_length if max_new_tokens is None else max_new_tokens
        self._check(source_ids, self.source_length, "`source_ids`", max_new_tokens)
        if max_new_tokens > self.max_length:  # it returned max_length tokens, no error
            raise ValueError(f"`max_new_tokens` must be at most {self.max_length}, the file's decoder positions "
                             f"(export with a larger `max_length` for more). Received: max_new_tokens={max_new_tokens}")
        check_int("beam_size", beam_size, allow_none=True, numpy=True)
        check_number("length_penalty", length_penalty)
        src = np.zeros((1, self.source_length), np.int32)
        src[0, : len(source_ids)] = source_ids
        self._encode(encoder_token_ids=src)  # its outputs are decode_step's inputs
        steps = int(max_new_tokens)
        if beam_size:
            return self._beam_search(steps, int(beam_size), float(length_penalty))
        self._start(self._caches)
        token, new = START_ID, []
        for index in range(steps):
            token = int(np.argmax(self._decode(token, index)))
            new.append(token)
            if token == END_ID:
                break
        return new

    def _beam_search(self, steps, beams, length_penalty):
        """`BeamSampler.run` for one row, one decoder call per live beam and step: scores are float32 sums of
        log-probabilities; a finished beam continues with padding at no cost; ties go to the lower (beam, token)
        index, as `tf.math.top_k` does; the best beam at the end by `score / ((5 + length) / 6) ** length_penalty`.
        Each beam has cache buffers of its own; a beam that continues another's takes a copy of its caches.
        """
        vocab = self.vocabulary_size
        while len(self._beam_caches) < beams:
            self._beam_caches.append({name: self._step.new_buffer(name) for name in self.cache_names})
        caches = self._beam_caches[:beams]
        for cache in caches:
            self._start(cache)
        tokens = np.zeros((beams, steps), np.int64)  # (K, N)
        scores = np.full(beams, BEAM_NEG, np.float32)
        scores[0] = 0.0  # only beam 0 is live at the start
        finished = np.zeros(beams, bool)
        lengths = np.zeros(beams, np.int32)
        last = np.full(beams, START_ID)
        for index in range(steps):
            if finished.all():  # every candidate is a beam's padding at its score: only the order can change
                source, token = np.argsort(-scores, kind="stable"), np.full(beams, PAD_ID)
                scores = scores[source]
            else:
                log_probs = np.zeros((beams, vocab), np.float32)  # (K, V)
                for k in range(beams):
                    if finished[k]:
                        log_probs[k] = BEAM_NEG
                        log_probs[k, PAD_ID] = 0.0
                    elif scores[k] > BEAM_NEG:  # a beam at BEAM_NEG (the start) is never chosen: no call
                        self._bind(caches[k])
                        log_probs[k] = _log_softmax(self._decode(int(last[k]), index))
                total = (scores[:, None] + log_probs).reshape(-1)  # (K*V,) float32
                order = np.argsort(-total, kind="stable")[:beams]  # top_k: the lower index first among equals
                scores, source, token = total[order], order // vocab, order % vocab
                self._reorder(caches, source)
            tokens = tokens[source]
            tokens[:, index] = token
            generated = ~finished[source]
            lengths = lengths[source] + generated.astype(np.int32)
            finished = finished[source] | (token == END_ID)
            last = token
        self._bind(self._caches)
        penalty = np.power((np.float32(5.0) + lengths.astype(np.float32)) / np.float32(6.0), np.float32(length_penalty))
        row = tokens[int(np.argmax(scores / penalty))].tolist()
        return cut_at_end(row, END_ID, keep_end=True)

    def _reorder(self, caches, source):
        """Beam `j` continues beam `source[j]`: the caches that change take a copy of their source's."""
        moved = [j for j in range(len(caches)) if source[j] != j]
        held = {int(source[j]): {name: self._step.read(name, buffer) for name, buffer in caches[source[j]].items()}
                for j in moved}  # before any write
        for j in moved:
            for name, array in held[int(source[j])].items():
                self._step.write(name, array, caches[j][name])

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

    def translate_text(self, text, max_new_tokens=None, beam_size=None, length_penalty=0.6):
        """Seq2seq, text in and out with the same placeholder protection as the SavedModel's `serving_default`
        (`tfformer.data.placeholders`): every placeholder and the edge whitespace of `text` are in the result.
        `beam_size` and `length_penalty` as in `translate` (the SavedModel's export options)."""
        from tfformer.data import placeholders

        masked = placeholders.mask(text)
        if not masked.translatable:
            return text
        source = self.tokenize(masked.text)[: self.source_length]  # the SavedModel truncates sources alike
        new = self.translate(source, max_new_tokens=max_new_tokens, beam_size=beam_size,
                             length_penalty=length_penalty) if source else []
        new = cut_at_end(new, END_ID)
        return placeholders.restore(masked, self.detokenize(new))


def _log_softmax(logits):
    """float32 log-probabilities of one row of logits."""
    logits = np.asarray(logits, np.float32)
    shifted = logits - logits.max()
    return shifted - np.log(np.sum(np.exp(shifted), dtype=np.float32))


def _as_str(value):
    """A detokenizer's result (str, bytes, or a scalar / one-element string tensor or array) as str."""
    value = value.numpy() if hasattr(value, "numpy") else value
    value = np.asarray(value).reshape(-1)[0] if not isinstance(value, (str, bytes)) else value
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
