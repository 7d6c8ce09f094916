"""Benchmarks that ship with the package: the online serving benchmark (`vllm bench serve`,
serve.py) with its datasets, streaming client and metrics, and the engine step statistics
that a server run and an offline run (the repository's benchmarks/) report alike.

The repository's benchmarks/ (kernels, engine, TP, accuracy, serving sweeps) import these
modules; nothing here imports benchmarks/, which is not installed.
"""
