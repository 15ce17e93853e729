"""Benchmarks of aruntime: ``python benchmarks/run.py`` collects and runs every ``bench_*.py`` module."""
