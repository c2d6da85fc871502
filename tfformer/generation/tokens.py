"""The special token ids decoding relies on, defined once for `tfformer.generation` (the tokenizers' ids)."""

PAD_ID, START_ID, END_ID = 0, 2, 3
