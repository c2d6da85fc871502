"""TransformerConfig: one vocabulary of hyperparameter names for every model."""

import dataclasses
import json
from typing import Optional

from tfformer.checks import check_int, check_number, check_one_of
from tfformer.layers.feedforward import ACTIVATIONS
from tfformer.layers.layer_utils import check_dropout

ARCHITECTURES = ("seq2seq", "encoder", "causal_lm", "regressor", "speech_seq2seq")
POSITIONS = ("sinusoidal", "learned", "rotary")
NORMALIZATIONS = ("layer", "rms")
SCORES = ("scaled_dot", "dot", "general", "additive")


@dataclasses.dataclass
class TransformerConfig:
    """Hyperparameters of a Transformer, shared by every builder.

    `architecture` picks the builder: `"seq2seq"` (the paper's encoder-decoder),
    `"encoder"` (BERT-style), `"causal_lm"` (GPT-style), `"regressor"`
    (encoder over continuous vectors, `input_dim` features per step) or
    `"speech_seq2seq"` (Whisper: a convolutional stem on `num_mel_bins` log-mel
    features per frame, `max_source_positions` encoder positions after it).
    Token id 0 is padding in every token model.
    """

    architecture: str = "seq2seq"
    vocabulary_size: int = 37000  # the paper's shared source/target BPE vocabulary
    hidden_dim: int = 512  # d_model
    num_heads: int = 8
    num_key_value_heads: Optional[int] = None  # grouped-query attention; None = num_heads
    intermediate_dim: int = 2048  # d_ff
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout: float = 0.1
    max_sequence_length: int = 512
    activation: str = "relu"
    norm_first: bool = False  # the paper is post-LN
    layer_norm_epsilon: float = 1e-5
    position: str = "sinusoidal"  # or "learned", or "rotary" (causal_lm: on q and k, `rope_max_wavelength`)
    scale_embeddings: bool = True  # multiply token embeddings by sqrt(d_model)
    tie_embeddings: bool = True  # share source, target and pre-softmax matrices
    score: str = "scaled_dot"
    num_segments: int = 0  # BERT token-type vocabulary; 0 = no segment_ids input
    num_classes: Optional[int] = None  # encoder: add a classifier head on pooled_output
    input_dim: Optional[int] = None  # regressor: features per timestep
    output_dim: int = 1  # regressor: predicted values per sequence
    initializer_range: Optional[float] = None  # stddev of a truncated normal init; None = Glorot
    num_mel_bins: Optional[int] = None  # speech_seq2seq: log-mel features per input frame
    max_source_positions: Optional[int] = None  # speech_seq2seq: encoder positions (input frames / 2)
    normalization: str = "layer"  # causal_lm: or "rms" (RMSNorm, Llama), both with layer_norm_epsilon
    use_bias: bool = True  # causal_lm: False = no projection biases (a gated feed-forward: activation="swiglu")
    rope_max_wavelength: float = 10000.0  # position="rotary": the rotary base (keras-hub's Llama name)

    def __post_init__(self):
        self._check_values()
        self._check_architecture()

    def _check_values(self):
        """Each field's type and range, and the head counts that must divide."""
        for name, allowed in (("architecture", ARCHITECTURES), ("position", POSITIONS), ("activation", ACTIVATIONS),
                              ("score", SCORES), ("normalization", NORMALIZATIONS)):
            check_one_of(name, getattr(self, name), allowed)
        for name in ("vocabulary_size", "hidden_dim", "num_heads", "intermediate_dim", "max_sequence_length",
                     "output_dim"):
            check_int(name, getattr(self, name))
        for name in ("num_encoder_layers", "num_decoder_layers", "num_segments"):
            check_int(name, getattr(self, name), minimum=0)
        for name in ("num_classes", "input_dim", "num_key_value_heads", "num_mel_bins", "max_source_positions"):
            check_int(name, getattr(self, name), allow_none=True)
        if self.num_key_value_heads is not None and self.num_heads % self.num_key_value_heads:
            raise ValueError(
                "`num_key_value_heads` must divide `num_heads`. "
                f"Received: num_key_value_heads={self.num_key_value_heads}, num_heads={self.num_heads}"
            )
        if self.hidden_dim % self.num_heads:
            raise ValueError(
                f"`hidden_dim` must be divisible by `num_heads`. "
                f"Received: hidden_dim={self.hidden_dim}, num_heads={self.num_heads}"
            )
        check_dropout(self.dropout)
        check_number("layer_norm_epsilon", self.layer_norm_epsilon, at_least=0, expected="a non-negative float")

    def _check_architecture(self):
        """What `architecture` needs, and the variants only some architectures build."""
        if self.architecture == "regressor" and self.input_dim is None:
            raise ValueError("`input_dim` is required when architecture='regressor'. Received: input_dim=None")
        if self.architecture == "speech_seq2seq":
            for name in ("num_mel_bins", "max_source_positions"):
                if getattr(self, name) is None:
                    raise ValueError(f"`{name}` is required when architecture='speech_seq2seq'. Received: {name}=None")
        # Only CausalLM's DecoderBlocks take the Llama-style variants.
        for name, value in {"position": "rotary", "normalization": "rms", "use_bias": False}.items():
            if getattr(self, name) == value and self.architecture != "causal_lm":
                raise ValueError(f"`{name}={value!r}` is only built by architecture='causal_lm'. "
                                 f"Received: architecture={self.architecture!r}")
        if not isinstance(self.use_bias, bool):
            raise ValueError(f"`use_bias` must be a bool. Received: use_bias={self.use_bias!r}")
        if not self.use_bias and self.activation != "swiglu":
            raise ValueError(f"`use_bias=False` needs activation='swiglu'. Received: activation={self.activation!r}")
        check_number("rope_max_wavelength", self.rope_max_wavelength, above=1)
        if self.position == "rotary" and self.head_dim % 2:
            raise ValueError(f"position='rotary' needs an even head_dim (hidden_dim / num_heads). "
                             f"Received: hidden_dim={self.hidden_dim}, num_heads={self.num_heads}")
        needs = {"seq2seq": ("num_encoder_layers", "num_decoder_layers"), "encoder": ("num_encoder_layers",),
                 "regressor": ("num_encoder_layers",), "causal_lm": ("num_decoder_layers",),
                 "speech_seq2seq": ("num_encoder_layers", "num_decoder_layers")}
        for name in needs[self.architecture]:
            check_int(name, getattr(self, name))

    @property
    def head_dim(self):
        return self.hidden_dim // self.num_heads

    @property
    def key_value_heads(self):
        """Key/value heads of every attention layer (`num_key_value_heads`, or `num_heads`): the caches' `K`."""
        return self.num_key_value_heads or self.num_heads

    def replace(self, **overrides):
        """A copy with some fields changed (validated); unknown names raise ValueError."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"Unknown config field(s) {unknown}. Allowed: "
                             f"{sorted(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **overrides)

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data):
        return cls().replace(**dict(data))

    def to_json(self):
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text):
        return cls.from_dict(json.loads(text))
