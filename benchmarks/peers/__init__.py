"""Peer runtimes that benchmarks/bench_peers.py compares aruntime with, each in its own environment."""
