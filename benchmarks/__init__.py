"""Benchmarks: tfformer against keras-hub (and PyTorch where installed) on the same machine, same run."""

# `--systems` of the runner and of the training, generation and asr workloads: every system ("all"), or only the
# PyTorch rows and the rows they are read against ("peers"; asr: every row but the XLA one, and its goals).
# "peers" is for smoke runs alone: the smoke tests check with it what stand-in peers change, and everything else in
# their runs without peers.
SYSTEMS = ("all", "peers")
