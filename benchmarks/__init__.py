"""Benchmarks: tfformer against keras-hub (and PyTorch where installed) on the same machine, same run."""
