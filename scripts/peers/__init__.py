"""Helpers of `scripts/bench_peers.py`: a torchft job on this machine, its training script, and the measures."""
