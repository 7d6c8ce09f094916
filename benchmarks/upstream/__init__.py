"""Upstream vLLM's Triton kernels for the benchmarks to compare with: extract_vllm033.py
builds them from the PyPI wheel into the git-ignored ``.upstream/`` (never committed)."""
