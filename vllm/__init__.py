"""Mamba2 inference in vLLM's layout, served through this project's Triton causal-conv1d kernels.

Kept light on purpose: importing `vllm` loads neither torch nor triton.
"""

__version__ = "0.1.0"
