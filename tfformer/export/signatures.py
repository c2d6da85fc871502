"""Names and specs of the exported signatures (shared with the server and the edge runtime).

Every exported function takes named inputs and returns a dict with fixed keys.
"""

import tensorflow as tf

SERVING_DEFAULT = "serving_default"  # raw strings in, strings (or embeddings) out
PREDICT_IDS = "predict_ids"  # token ids in, float32 logits out
GENERATE_IDS = "generate_ids"  # token ids in, generated ids out
GENERATE_TEXT = "generate_text"  # causal LM: strings and a max_new_tokens per string in, completions out
SEGMENTS = "segments"  # Whisper: waveforms in, timestamped segments out

TEXT = "text"
TRANSLATION = "translation"
CONTINUATION = "continuation"
EMBEDDING = "embedding"
LOGITS = "logits"
TOKEN_IDS = "token_ids"
MAX_NEW_TOKENS = "max_new_tokens"
# Speech (Whisper): 16 kHz waveforms and their lengths in, or log-mel features; `text` out.
WAVEFORM = "waveform"
LENGTHS = "lengths"
INPUT_FEATURES = "input_features"
DECODER_TOKEN_IDS = "decoder_token_ids"
# Whisper's `segments`: per row, `(B, S)` padded to the batch's largest segment count, and `(B,)` per window.
SEGMENT_TEXT = "segment_text"
SEGMENT_START = "segment_start"
SEGMENT_END = "segment_end"
NUM_SEGMENTS = "num_segments"
AVG_LOGPROB = "avg_logprob"
NO_SPEECH_PROB = "no_speech_prob"


def ids_spec(name, batch=None, length=None):
    return tf.TensorSpec([batch, length], tf.int32, name=name)


def text_spec(name=TEXT):
    return tf.TensorSpec([None], tf.string, name=name)


def count_spec(name=MAX_NEW_TOKENS):
    """One int32 count per row `(B,)`: TF Serving's row format (`instances`) stacks every input along the batch, so a
    per-row input serves in both REST formats and over gRPC, where a scalar would not fit `instances`."""
    return tf.TensorSpec([None], tf.int32, name=name)


def waveform_spec(name=WAVEFORM):
    """Float32 16 kHz samples `(B, N)`, each row right-padded to the batch's longest."""
    return tf.TensorSpec([None, None], tf.float32, name=name)


def features_spec(num_frames, num_mel_bins, batch=None, name=INPUT_FEATURES):
    """Log-mel features `(B, frames, mel bins)` float32, channels last."""
    return tf.TensorSpec([batch, num_frames, num_mel_bins], tf.float32, name=name)
