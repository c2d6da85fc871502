"""The `tfformer` command. Glue only: every piece of logic lives in the library."""

import argparse
import collections
import os
import sys


def _overrides(pairs):
    """`--set hidden_dim=64 --set dropout=0.0` -> {"hidden_dim": 64, "dropout": 0.0}."""
    import json

    result = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ValueError(f"--set expects name=value, received {pair!r}.")
        name, value = pair.split("=", 1)
        try:
            result[name] = json.loads(value)
        except json.JSONDecodeError:
            result[name] = value
    return result


def _demo(args):
    minutes = float(os.environ.get("DEMO_MINUTES", "15"))
    from tfformer.recipes import translation

    import time

    out = args.out or time.strftime("runs/demo-en-de-%Y%m%d-%H%M%S")
    print(f"tfformer demo: English→German on this machine's gettext catalogs, {minutes:g} minutes in all.")
    metrics = translation.train_translation(out, time_budget=f"{minutes}m")
    print(f"\nRun written to {out}/ (model.keras, tokenizer.model, config.json, metrics.json, loss.png, samples.txt).")
    print(f"BLEU {metrics['bleu_test']:.2f} on {metrics['test_pairs']} test pairs.")
    print("Next:")
    print(f"  .venv/bin/tfformer translate --run {out} \"File not found\"")
    print(f"  .venv/bin/tfformer evaluate --run {out}")
    print(f"  .venv/bin/tfformer export {out} --format all --out export/models/en-de")
    print("  .venv/bin/tfformer serve --model_name en-de --model_base_path export/models/en-de")
    return 0


def _train(args):
    from tfformer.recipes import language_model, translation

    common = dict(time_budget=args.time_budget, overwrite=args.overwrite, replicas=args.replicas,
                  mixed_precision=args.mixed_precision, batch_size=args.batch_size, eval_every=args.eval_every)
    overrides = _overrides(args.set)
    # The command's own options, which go to the recipe by these names too.
    own = {**{name: f"--{name.replace('_', '-')}" for name in common}, "out": "--out", "preset": "--preset",
           "target_language": "--target-language", "data_file": "--data", "text_files": "--text",
           "cpu_threads": "the command (it sets it)"}
    for name in sorted(set(overrides) & set(own)):
        raise ValueError(f"--set {name}=...: give {name} with {own[name]} instead.")
    common.update(overrides)
    if args.task == "translation":
        translation.train_translation(args.out, preset=args.preset or "transformer-tiny",
                                      target_language=args.target_language, data_file=args.data, **common)
    else:
        # This process only trains: one share of the cores per micro-batch (training.configure_cpu_threads).
        language_model.train_lm(args.out, preset=args.preset or "gpt-mini", text_files=args.text, cpu_threads=True,
                                **common)
    return 0


def _translate(args):
    from tfformer.recipes import translation

    if args.po:
        if args.texts:
            raise ValueError("Give TEXT... or --po CATALOG, not both.")
        if not args.out:
            raise ValueError("--po needs --out, the .po file to write (e.g. --out de.po).")
        result = translation.translate_catalog(args.run, args.po, args.out, overwrite=args.overwrite,
                                               batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                                               beam_size=args.beam_size)
        if result["written"] is None:
            print(f"tfformer: {args.po}: every entry is already translated (or fuzzy); nothing to do, "
                  f"{args.out} not written.", file=sys.stderr)
        else:
            print(f"{args.out}: {result['translated']} entries machine-translated and marked fuzzy "
                  f"({result['messages']} messages).", file=sys.stderr)
        return 0
    if not args.texts:
        raise ValueError("Give TEXT... to translate, or --po CATALOG --out OUT.po.")
    if not all(text.strip() for text in args.texts):
        raise ValueError("`texts` holds an empty or whitespace-only string; there is nothing to translate.")
    translator = translation.load_run(args.run)
    beam_size = translation.BEAM_SIZE if args.beam_size is None else args.beam_size  # as the run was evaluated
    max_new_tokens = 64 if args.max_new_tokens is None else args.max_new_tokens  # 0 is an error, not the default
    for line in translator.translate(args.texts, max_new_tokens=max_new_tokens, beam_size=beam_size,
                                     length_penalty=translation.LENGTH_PENALTY):
        print(line)
    return 0


def _causal_lm(args):
    """The causal LM of `--run` or `--preset` (`generate`, `chat`)."""
    from tfformer import models

    flag, name = ("--run", args.run) if args.run else ("--preset", args.preset)
    lm = models.from_preset(name)
    if not isinstance(lm, models.CausalLM):
        raise ValueError(f"{flag} {name} is a {type(lm).__name__}, not a causal LM: `tfformer {args.command}` "
                         "continues text with one, e.g. --preset smollm2-135m-instruct, or a run of `tfformer train "
                         "lm` or `tfformer finetune`.")
    return lm


def _generate(args):
    lm = _causal_lm(args)
    # One prompt at a time, streamed: `stream`'s step is traced once, where `generate`'s XLA loop compiles first
    # (SmolLM2-135M-Instruct, 8 new tokens: 8.5 s against 35 s before any text; AMD EPYC Zen 3).
    streams = [lm.stream(prompt, max_new_tokens=args.max_new_tokens) for prompt in args.prompts]  # all checked
    for pieces in streams:
        for piece in pieces:
            print(piece, end="", flush=True)
        print(flush=True)
    return 0


def _finetune(args):
    from tfformer.recipes import finetune

    losses = finetune.finetune_lm(args.out, preset=args.run or args.preset, chat=args.chat, text=args.text,
                                  lora_rank=args.lora_rank, steps=args.steps, batch_size=args.batch_size,
                                  sequence_length=args.sequence_length, learning_rate=args.learning_rate,
                                  system_prompt=args.system, replicas=args.replicas, overwrite=args.overwrite)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; preset: {args.out} "
          f"(`tfformer chat --run {args.out}`)")
    return 0


def _chat(args):
    from tfformer import edge

    lm = edge.Chat(args.litertlm) if args.litertlm else _causal_lm(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = not args.message and sys.stdin.isatty()
    lines = iter(args.message or sys.stdin)
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = next(lines, None)
        if line is None:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = ""
        for piece in lm.chat(messages, max_new_tokens=args.max_new_tokens, stream=True):
            print(piece, end="", flush=True)
            reply += piece
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})


def _export_speech(args, model):
    """A Whisper task: the SavedModel (waveform in, text out) and one TFLite file for `tfformer.edge.Transcriber`."""
    from tfformer import export

    for name in ("sequence_length", "batch_size"):
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} fixes model.tflite's token ids; a Whisper TFLite file "
                             "takes one 30-second window of log-mel frames (batch 1): leave it out.")
    _output_directory(args.out)
    if args.format in ("saved_model", "all"):
        path = export.saved_model(model, args.out, version=args.version, max_new_tokens=args.max_new_tokens,
                                  beam_size=args.beam_size, warmup_batch_sizes=args.warmup_batch_sizes)
        print(f"SavedModel: {path}  (serving_default: waveform, lengths -> text; segments: the same -> segment_text, "
              f"segment_start, segment_end, num_segments; `tfformer serve --model_name NAME --model_base_path "
              f"{args.out}`)")
    if args.format in ("tflite", "all"):
        path = export.tflite_decoder(model, os.path.join(args.out, "model.tflite"), max_length=args.max_length,
                                     quantize=args.quantize)
        print(f"TFLite: {path} (encoder + single-step decoder: tfformer.edge.Transcriber(path, tokenizer="
              f"tfformer.models.from_preset({args.run!r}).preprocessor))")
    return 0


def _export_litertlm(args):
    """A causal LM as one .litertlm bundle (model, tokenizer, metadata) for Google's LiteRT-LM runtime."""
    from tfformer import export, models

    from tfformer.export.litertlm import default_quantize

    held = [models.from_preset(args.run)]
    quantize, kv_cache = args.quantize or default_quantize(held[0]), args.kv_cache or "dynamic"
    _output_directory(args.out)
    # `held.pop` hands the model over: the export drops it before the converter runs (`export.litertlm`).
    path = export.litertlm(held.pop, os.path.join(args.out, "model.litertlm"), quantize=quantize,
                           context_length=args.max_length, kv_cache=kv_cache)
    print(f"LiteRT-LM: {path} ({quantize} weights, {kv_cache} KV cache; litert_lm.Engine({path!r}), or LiteRT-LM's "
          "Android/iOS/desktop APIs)")
    return 0


# The formats each `tfformer export` option is for: one given for another --format is refused, not ignored.
EXPORT_OPTIONS = {"version": {"saved_model"}, "max_new_tokens": {"saved_model"}, "beam_size": {"saved_model"},
                  "warmup_batch_sizes": {"saved_model"}, "sequence_length": {"tflite"}, "batch_size": {"tflite"},
                  "max_length": {"tflite", "litertlm"}, "kv_cache": {"litertlm"}, "quantize": {"tflite", "litertlm"}}


def _export(args):
    from tfformer import export, models

    litert_lm = args.format == "litertlm"
    tflite_quantize = ("dynamic", "float16", "gguf")
    formats = {"saved_model", "tflite"} if args.format == "all" else {args.format}
    for name, allowed in EXPORT_OPTIONS.items():
        if getattr(args, name) is not None and not allowed & formats:
            raise ValueError(f"--{name.replace('_', '-')} is for --format {' or '.join(sorted(allowed))}. Received: "
                             f"--format {args.format}")
    if args.quantize is not None and (args.quantize in tflite_quantize) == litert_lm:
        allowed = ("none", "int8", "int4") if litert_lm else tflite_quantize
        raise ValueError(f"--quantize {args.quantize} is not for --format {args.format}; use one of {allowed}.")
    _output_directory(args.out, make=False)  # made once the model has loaded and the options passed
    if litert_lm:
        return _export_litertlm(args)
    # A run directory or a pretrained preset, e.g. all-minilm-l6-v2 or whisper-tiny-en.
    model = models.from_preset(args.run)
    if isinstance(model, models.WhisperModel):  # speech in, text out
        return _export_speech(args, model)
    _output_directory(args.out)
    tokenizer = model.preprocessor
    if isinstance(model, models.SentenceEncoder):  # text -> embedding; no decoder
        if args.format in ("saved_model", "all"):
            path = export.saved_model(model, args.out, version=args.version,
                                      warmup_batch_sizes=args.warmup_batch_sizes)
            print(f"SavedModel: {path}  (serving_default: text -> embedding; predict_ids: token_ids, padding_mask)")
        if args.format in ("tflite", "all"):
            ids = export.tflite(model, os.path.join(args.out, "model.tflite"), quantize=args.quantize,
                                sequence_length=args.sequence_length, batch_size=args.batch_size)
            print(f"TFLite: {ids} (token_ids, padding_mask -> embedding; tokenize on the host)")
        return 0
    beam_size = args.beam_size
    if beam_size is None and isinstance(model, models.Seq2SeqTransformer):
        from tfformer.recipes import translation

        beam_size = translation.BEAM_SIZE  # a translator serves as its run was evaluated
    if args.format in ("saved_model", "all"):
        path = export.saved_model(model, args.out, version=args.version, tokenizer=tokenizer,
                                  max_new_tokens=args.max_new_tokens, beam_size=beam_size,
                                  warmup_batch_sizes=args.warmup_batch_sizes)
        print(f"SavedModel: {path}  (serve: docker run ... tensorflow/serving, or `tfformer serve "
              f"--model_name NAME --model_base_path {args.out}`)")
    if args.format in ("tflite", "all"):
        ids = export.tflite(model, os.path.join(args.out, "model.tflite"), quantize=args.quantize,
                            sequence_length=args.sequence_length, batch_size=args.batch_size)
        # A tokenizer with TF-Text TFLite ops goes into the file; a byte-pair one stays on the host (edge.Generator).
        in_file = tokenizer if hasattr(tokenizer, "tokenize_for_tflite") else None
        decoder = export.tflite_decoder(model, os.path.join(args.out, "decoder.tflite"), tokenizer=in_file,
                                        max_length=args.max_length, quantize=args.quantize)
        where = "+ tokenizer" if in_file is not None else "(tokenize on the host: edge.Generator(path, tokenizer=...))"
        print(f"TFLite: {ids} (token ids -> logits), {decoder} (single-step decoder {where}, for tfformer.edge)")
    return 0


def _evaluate(args):
    from tfformer.recipes import rundir, translation

    translator = translation.load_run(args.run)
    run_file = os.path.join(args.run, translation.RUN_FILE)
    if not os.path.exists(run_file):
        raise ValueError(f"--run {args.run} has no {translation.RUN_FILE}: `tfformer evaluate` scores a run of "
                         "`tfformer train translation` on its own data's split.")
    run = rundir.read_json(run_file)
    splits = translation.load_pairs(run["target_language"], run["data_file"])
    pairs = translation.filter_by_length(splits[args.split], translator.preprocessor, run["max_length"])
    bleu, _ = translation.evaluate_bleu(translator, pairs, max_new_tokens=run["max_length"])
    print(f"BLEU {bleu:.2f} on {len(pairs)} {args.split} pairs")
    return 0


def _demo_presets(args):
    import numpy as np

    from tfformer import models

    for name in models.list_presets():
        config = models.get_preset(name)
        model = models.build_model(config)
        ids = np.random.default_rng(0).integers(1, config.vocabulary_size, size=(1, 8)).astype("int32")
        inputs = {
            "seq2seq": {"encoder_token_ids": ids, "decoder_token_ids": ids},
            "speech_seq2seq": {"input_features": np.zeros((1, 2 * 8, config.num_mel_bins or 0), "float32"),
                               "decoder_token_ids": ids},
        }.get(config.architecture, {"token_ids": ids})
        if config.num_segments:
            inputs["segment_ids"] = np.zeros_like(ids)
        outputs = model(inputs, training=False)
        shapes = {k: tuple(v.shape) for k, v in outputs.items()} if isinstance(outputs, dict) else tuple(outputs.shape)
        print(f"  {name:18s} {config.architecture:10s} params={model.count_params():>12,d}  output={shapes}")
    return 0


def _presets(args):
    from tfformer import models

    if args.build:
        return _demo_presets(args)
    for name in models.list_presets():
        print(name, models.get_preset(name).to_json().replace("\n", " "))
    return 0


def _embed(args):
    from tfformer import models

    model = models.from_preset(args.preset)
    if not isinstance(model, models.SentenceEncoder):
        raise ValueError(
            f"`--preset` must be a sentence-embedding preset such as 'all-minilm-l6-v2'. Received: {args.preset!r}"
        )
    vectors = model.encode(args.texts, batch_size=args.batch_size)
    rows, digits = (models.cosine_similarity(vectors), 4) if args.similarity else (vectors, 6)
    for row in rows:
        print(" ".join(f"{value:.{digits}f}" for value in row))
    return 0


def _batch_sizes(text):
    """`--warmup-batch-sizes`: comma-separated ints >= 1, or `none` for no warm-up records."""
    if text.strip().lower() == "none":
        return ()
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1 (e.g. 1,8,32) or none, received "
                                         f"{text!r}")
    return sizes


def _flag_bool(text):
    """A TF Serving bool flag's value: `--enable_batching` alone, or `--enable_batching=true|false|1|0`."""
    value = {"true": True, "1": True, "false": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, received {text!r}")
    return value


def _serve(args):
    from tfformer import serving

    if bool(args.model_config_file) == bool(args.model_base_path):
        raise ValueError("Give --model_base_path (with --model_name) or --model_config_file.")
    for flag, value, low, high in (("--port", args.port, 0, 65535), ("--rest_api_port", args.rest_api_port, 0, 65535),
                                   ("--rest_api_num_threads", args.rest_api_num_threads, 1, None)):
        if value < low or (high is not None and value > high):
            raise ValueError(f"{flag} must be an integer in [{low}, {high or 'inf'}]. Received: {flag} {value}")
    options = dict(
        model_name=args.model_name, model_base_path=args.model_base_path, model_config_file=args.model_config_file,
        host=args.host, port=args.port, rest_api_port=args.rest_api_port or None,
        file_system_poll_wait_seconds=args.file_system_poll_wait_seconds,
        model_config_file_poll_wait_seconds=args.model_config_file_poll_wait_seconds,
        rest_api_timeout_in_ms=args.rest_api_timeout_in_ms, max_request_bytes=args.max_request_bytes,
        num_workers=args.rest_api_num_threads, access_log=args.access_log or None,
        grace_period_seconds=args.grace_period_seconds, max_num_load_retries=args.max_num_load_retries,
        load_retry_interval_micros=args.load_retry_interval_micros,
        allow_version_labels_for_unavailable_models=args.allow_version_labels_for_unavailable_models,
        enable_batching=args.enable_batching, batching_parameters_file=args.batching_parameters_file,
        monitoring_config_file=args.monitoring_config_file, enable_model_warmup=args.enable_model_warmup,
        num_request_iterations_for_warmup=args.num_request_iterations_for_warmup,
    )
    try:
        return serving.run_server(**options)
    except serving.ServingError as error:
        print(f"tfformer: error: {error}", file=sys.stderr)
        return 1


def _serving_predict(args):
    from tfformer import serving

    try:
        lines = serving.predict_texts(args.server, args.model, args.texts, signature_name=args.signature_name,
                                      version=args.version, label=args.label, timeout=args.timeout)
    except serving.ServingError as error:
        print(f"tfformer: error: {error}", file=sys.stderr)
        return 1
    for line in lines:
        print(line)
    return 0


def _output_directory(out, make=True):
    """`--out` made if needed and checked writable, before the model loads; with `make=False` only checked: a file
    is refused, and a directory still to be made needs a writable parent."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"`--out` {out!r} is not a writable directory (it is a file).")
    if not make:
        parent = os.path.abspath(out)
        while not os.path.exists(parent):  # the nearest directory that exists: makedirs makes the rest in it
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"`--out` {out!r} cannot be made: {parent!r} is not a writable directory.")
        return out
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as error:
        raise ValueError(f"`--out` {out!r} cannot be made: {error.strerror or error}") from None
    if not os.path.isdir(out) or not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"`--out` {out!r} is not a writable directory.")
    return out


def _transcribe_files(asr, args, sources):
    """`--format`: each file's timestamped segments (from its `audio.open_wav` source, opened once) as a transcript
    file in `--out` (DIR/<name>.<format>), or on standard output."""
    from tfformer.files import write_atomic
    from tfformer.models import transcript

    options = transcript.TranscriptOptions.from_kwargs(max_new_tokens=args.max_new_tokens,
                                                       word_timestamps=args.word_timestamps)
    for path, source in zip(args.files, sources):
        segments = transcript.segments(asr, source, options)
        text = transcript.format_transcript(segments, args.format)
        if args.out is None:
            print(text, end="")
            continue
        print(write_atomic(os.path.join(args.out, _transcript_name(path, args.format)), text))
    return 0


def _transcript_name(path, format):
    """The file name of `path`'s transcript in `--out`: its own name with `format`'s extension."""
    return os.path.splitext(os.path.basename(path))[0] + "." + format


def _check_transcript_names(files, out, format):
    """A ValueError when two different input files would write the same transcript in `--out`."""
    sources = collections.defaultdict(set)  # transcript name -> the input files it would come from
    for path in files:
        sources[_transcript_name(path, format)].add(os.path.realpath(path))
    clashes = {name: sorted(paths) for name, paths in sources.items() if len(paths) > 1}
    if clashes:
        name, paths = next(iter(clashes.items()))
        raise ValueError(f"`--out` {out!r} would get one transcript {name!r} for {len(paths)} different files "
                         f"({', '.join(paths)}): transcribe them into separate --out directories.")


def _transcribe(args):
    from tfformer import models
    from tfformer.data import audio

    if args.out is not None and args.format is None:
        args.format = "txt"
    if args.word_timestamps and args.format in (None, "txt"):
        raise ValueError("`--word-timestamps` needs a timestamped format: pass --format srt, vtt or json. Received: "
                         f"--format {args.format}")
    if args.beam_size != 1 and args.format is not None:
        raise ValueError(f"`--beam-size` must be 1 with --format (timestamped decoding is greedy). Received: "
                         f"--beam-size {args.beam_size}")
    # Every file is read (or, with --format, opened) and checked before the model loads, so a bad one fails fast.
    waveforms = []
    for path in args.files:
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file.")
        waveforms.append(audio.read_wav(path) if args.format is None else audio.open_wav(path))
    if args.out is not None:
        _check_transcript_names(args.files, args.out, args.format)
        _output_directory(args.out)
    asr = models.from_preset(args.preset)
    if not isinstance(asr, models.WhisperModel):
        raise ValueError(f"`--preset` must be a speech-to-text preset such as 'whisper-tiny-en'. Received: "
                         f"{args.preset!r}")
    if args.format is not None:
        return _transcribe_files(asr, args, waveforms)
    texts = asr.transcribe(waveforms, sample_rate=audio.SAMPLE_RATE, max_new_tokens=args.max_new_tokens,
                           batch_size=args.batch_size, beam_size=args.beam_size)
    for path, text in zip(args.files, texts):
        print(f"{path}\t{' '.join(text.split())}")  # one line per file, whatever whitespace the text holds
    return 0


_OneOf = collections.namedtuple("_OneOf", "arguments required")


def _argument(*flags, **options):
    """One `add_argument(*flags, **options)` of a subcommand."""
    return flags, options


def _one_of(*arguments, required=False):
    """Mutually exclusive `arguments` of a subcommand (an argparse group)."""
    return _OneOf(arguments, required)


# The subcommands, in `tfformer --help` order: name -> (function, help, arguments); `_one_of` groups mutually
# exclusive arguments.
COMMANDS = {
    "demo": (_demo, "the main job: train English→German within DEMO_MINUTES (default 15)", [
        _argument("--out", help="run directory (default: a new runs/demo-en-de-<time>)"),
    ]),
    "train": (_train, "train a model", [
        _argument("task", choices=["translation", "lm"]),
        _argument("--preset"),
        _argument("--target-language", default="de"),
        _argument("--data", help="a TSV of source<TAB>target pairs instead of the gettext catalogs"),
        _argument("--text", nargs="+", help="text files for `lm` (default: the Python standard library)"),
        _argument("--time-budget", default="15m", help="e.g. 90s, 15m, 1h (vocabulary + training + evaluation)"),
        _argument("--out", required=True),
        _argument("--overwrite", action="store_true", help="replace an existing run directory"),
        _argument("--replicas", type=int, help="MirroredStrategy over N logical CPU devices"),
        _argument("--mixed-precision", action="store_true", help="mixed_bfloat16 on CPU, mixed_float16 on GPU"),
        _argument("--batch-size", type=int, default=64),
        _argument("--eval-every", type=int, default=200, help="validate (and back up) every N steps"),
        _argument("--set", action="append", metavar="NAME=VALUE", help="override a config field"),
    ]),
    "translate": (_translate, "translate TEXT... or a gettext catalog with a trained run", [
        _argument("--run", required=True),
        _argument("--max-new-tokens", type=int, help="default: 64 for TEXT, the model's limit for --po"),
        _argument("--beam-size", type=int, help="beams (default: 4, as a run is evaluated; 1: greedy)"),
        _argument("--po", help="a .pot or partly translated .po: fill its untranslated entries (fuzzy)"),
        _argument("--out", help="the .po file to write (with --po)"),
        _argument("--overwrite", action="store_true", help="replace an existing --out file"),
        _argument("--batch-size", type=int, default=32, help="messages per model call (with --po)"),
        _argument("texts", nargs="*", metavar="TEXT"),
    ]),
    "generate": (_generate, "continue PROMPT... with a trained run or a pretrained LM", [
        _one_of(
            _argument("--run", help="a run directory (or any preset directory)"),
            _argument("--preset", help="a pretrained preset, e.g. smollm2-135m-instruct"),
            required=True),
        _argument("--max-new-tokens", type=int, default=64),
        _argument("prompts", nargs="+"),
    ]),
    "chat": (_chat, "chat with a pretrained LM, streaming its replies (one turn per line of standard input, or "
                    "--message)", [
        _one_of(
            _argument("--preset", default="smollm2-135m-instruct", help="default: %(default)s"),
            _argument("--run", help="a preset directory of a chat model"),
            _argument("--litertlm", help="a .litertlm bundle (`tfformer export --format litertlm`), run by "
                      "LiteRT-LM's runtime"),
        ),
        _argument("--message", action="append", help="a user turn; repeat for several (default: read stdin)"),
        _argument("--system", help="a system message before the first turn"),
        _argument("--max-new-tokens", type=int, default=256),
    ]),
    "finetune": (_finetune, "fine-tune a causal LM on a chat TSV or a text file and save it as a preset", [
        _one_of(
            _argument("--preset", default="smollm2-135m-instruct", help="default: %(default)s"),
            _argument("--run", help="a preset directory of a causal LM"),
        ),
        _one_of(
            _argument("--chat", help="prompt<TAB>answer lines; the loss is on the answers"),
            _argument("--text", help="a UTF-8 text file, one example per non-blank line"),
            required=True),
        _argument("--out", required=True, help="the preset directory to write"),
        _argument("--overwrite", action="store_true", help="replace a preset already in --out"),
        _argument("--lora-rank", type=int, default=4, help="low-rank adapters on the attention "
                  "projections, merged before saving; 0 trains every weight (default: %(default)s)"),
        _argument("--steps", type=int, default=100),
        _argument("--batch-size", type=int, default=8),
        _argument("--sequence-length", type=int, default=256),
        _argument("--learning-rate", type=float, default=2e-4),
        _argument("--system", help="a system message before each chat prompt"),
        _argument("--replicas", type=int, help="MirroredStrategy over N logical CPU devices"),
    ]),
    "export": (_export, "write a trained run or a pretrained preset as a TF Serving SavedModel and/or TFLite, "
               "or as a LiteRT-LM bundle", [
        _argument("run", help="a run directory, or a pretrained preset name (all-minilm-l6-v2, "
                  "smollm2-135m-instruct, whisper-tiny-en)"),
        _argument("--format", choices=["saved_model", "tflite", "litertlm", "all"], default="saved_model",
                  help="litertlm: a causal LM as one bundle for Google's LiteRT-LM runtime (not part of all)"),
        _argument("--out", required=True, help="the model's base path, e.g. export/models/en-de"),
        _argument("--version", type=int, help="default: one more than the highest existing version"),
        _argument("--max-new-tokens", type=int, help="the SavedModel's generation length (default: 64; "
                  "for Whisper every position after the prompt, 446)"),
        _argument("--beam-size", type=int, help="beams in the SavedModel (default: 4 for a translator, "
                  "greedy for a language model)"),
        _argument("--quantize", choices=["dynamic", "float16", "gguf", "none", "int8", "int4"], help="TFLite "
                  "quantization: dynamic, float16 or gguf (a model converted from a GGUF, e.g. "
                  "smollm2-135m-instruct, keeps its Q8_0/Q4_1 blocks exactly as int8); litertlm: int4 (default; int8 "
                  "when a dense layer's input width is not a multiple of 32), int8 or none (float32)"),
        _argument("--sequence-length", type=int, help="fix model.tflite's sequence length"),
        _argument("--max-length", type=int, help="decoder.tflite's (Whisper: model.tflite's) cache "
                  "positions, prompt + new tokens (default: the model's max_sequence_length; e.g. 512 for a "
                  "small LLM on a device); litertlm: the context length (default 2048, at most the model's)"),
        _argument("--kv-cache", choices=["dynamic", "static"], help="litertlm: dynamic (default: the runtime grows "
                  "the cache with the conversation; LiteRT-LM's CPU backend) or static (the whole context from the "
                  "start; what its GPU backend takes)"),
        _argument("--batch-size", type=int, help="fix model.tflite's batch size; with --sequence-length every "
                  "shape is static and LiteRT runs faster (e.g. --batch-size 1 for a device)"),
        _argument("--warmup-batch-sizes", type=_batch_sizes, help="batch sizes of the SavedModel's "
                  "TF Serving warm-up records, e.g. 1,8,32 to cover the batches --enable_batching forms; none: no "
                  "records (default: tfformer.export.warmup.BATCH_SIZES, 1,8)"),
    ]),
    "evaluate": (_evaluate, "BLEU of a translation run on a split", [
        _argument("--run", required=True),
        _argument("--split", default="test", choices=["train", "validation", "test"]),
    ]),
    "presets": (_presets, "list the preset zoo", [
        _argument("--build", action="store_true", help="build each preset and run one forward pass"),
    ]),
    "embed": (_embed, "sentence embeddings of TEXT... (one vector per line)", [
        _argument("texts", nargs="+", metavar="TEXT"),
        _argument("--similarity", action="store_true", help="print the cosine similarity matrix instead"),
        _argument("--preset", default="all-minilm-l6-v2",
                  help="a sentence-embedding preset (default: %(default)s)"),
        _argument("--batch-size", type=int, default=32),
    ]),
    "serve": (_serve, "serve SavedModels over TF Serving's REST and gRPC APIs", [
        _argument("--model_name", default="default", help="model name (default: %(default)s)"),
        _argument("--model_base_path", help="directory of numeric version directories"),
        _argument("--model_config_file", help="a models.config (ModelServerConfig text proto)"),
        _argument("--model_config_file_poll_wait_seconds", type=float, default=0.0),
        _argument("--file_system_poll_wait_seconds", type=float, default=1.0),
        _argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)"),
        _argument("--port", type=int, default=8500, help="gRPC port (0: any free port)"),
        _argument("--rest_api_port", type=int, default=8501, help="REST port (0: REST disabled)"),
        _argument("--rest_api_timeout_in_ms", type=int, default=30000),
        _argument("--rest_api_num_threads", type=int, default=4, help="worker threads (REST and gRPC)"),
        _argument("--max_request_bytes", type=int, default=16 * 1024 * 1024),
        _argument("--access_log", default="-", help="JSON-lines access log: '-' (stdout), a path, or ''"),
        _argument("--grace_period_seconds", type=float, default=30.0),
        _argument("--max_num_load_retries", type=int, default=5),
        _argument("--load_retry_interval_micros", type=int, default=60_000_000),
        _argument("--allow_version_labels_for_unavailable_models", action="store_true"),
        _argument("--enable_batching", type=_flag_bool, nargs="?", const=True, default=False,
                  help="batch concurrent predict requests (TF Serving's batching; tfformer/serving/README.md)"),
        _argument("--batching_parameters_file", help="a BatchingParameters text proto (default: TF Serving's "
                  "defaults: max_batch_size 1000, batch_timeout_micros 0, max_enqueued_batches 10, "
                  "num_batch_threads = cores)"),
        _argument("--monitoring_config_file", help="a MonitoringConfig text proto; prometheus_config { enable: "
                  "true } serves metrics at /monitoring/prometheus/metrics on the REST port"),
        _argument("--enable_model_warmup", type=_flag_bool, nargs="?", const=True, default=True,
                  help="replay assets.extra/tf_serving_warmup_requests before a version serves (default: true)"),
        _argument("--num_request_iterations_for_warmup", type=int, default=0,
                  help="runs of each warm-up record (used only if > 0, else 1)"),
    ]),
    "predict": (_serving_predict, "send TEXT... to a model server's serving_default signature", [
        _argument("texts", nargs="+", metavar="TEXT"),
        _argument("--server", default="http://127.0.0.1:8501", help="http://host:port or grpc://host:port"),
        _argument("--model", required=True),
        _argument("--signature_name"),
        _argument("--version", type=int),
        _argument("--label"),
        _argument("--timeout", type=float, default=30.0),
    ]),
    "transcribe": (_transcribe, "speech to text: print PATH<TAB>TEXT for each WAV file", [
        _argument("files", nargs="+", metavar="WAV", help="WAV files (any sample rate; stereo is mixed "
                  "down with a warning); audio over 30 s is transcribed in windows cut at pauses"),
        _argument("--preset", default="whisper-tiny-en", help="a speech-to-text preset or preset "
                  "directory (default: %(default)s)"),
        _argument("--max-new-tokens", type=int, help="tokens per 30-second window (default: all that fit)"),
        _argument("--batch-size", type=int, default=8, help="30-second windows per model call"),
        _argument("--beam-size", type=int, default=1, help="beam search over N hypotheses, as "
                  "faster-whisper's (its default is 5); 1 is greedy (default: %(default)s)"),
        _argument("--format", choices=["txt", "srt", "vtt", "json"], help="write a timestamped transcript per file "
                  "(faster-whisper's long-form decoding: windows moved by the timestamps, conditioned on the "
                  "previous text) instead of PATH<TAB>TEXT lines"),
        _argument("--word-timestamps", action="store_true", help="word times from cross-attention (srt, vtt, "
                  "json)"),
        _argument("--out", metavar="DIR", help="write DIR/<name>.<format> per file (default: standard output)"),
    ]),
}


def _add_arguments(parser, arguments):
    for argument in arguments:
        if isinstance(argument, _OneOf):
            _add_arguments(parser.add_mutually_exclusive_group(required=argument.required), argument.arguments)
        else:
            flags, options = argument
            parser.add_argument(*flags, **options)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tfformer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (fn, help, arguments) in COMMANDS.items():
        command = commands.add_parser(name, help=help)
        _add_arguments(command, arguments)
        command.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as error:  # bad input; a missing file is one (`chat --litertlm`)
        print(f"tfformer: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
