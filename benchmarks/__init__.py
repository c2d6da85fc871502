"""Benchmarks: tfformer against keras-hub (and PyTorch where installed) on the same machine, same run."""

# `--systems` of the runner and of the training and generation workloads: every system ("all"), or only the PyTorch
# rows and the rows they are read against ("peers"). "peers" is for smoke runs alone: the runner's smoke test
# checks with it what stand-in peers change, and everything else in its run without peers.
SYSTEMS = ("all", "peers")
