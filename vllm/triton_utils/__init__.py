"""Triton, or a placeholder when Triton is not installed.

Import ``triton`` and ``tl`` from here, never directly, so that kernel modules import on
a machine without Triton::

    from vllm.triton_utils import HAS_TRITON, tl, triton

With Triton installed these are the real ``triton`` and ``triton.language``. Without it
they are placeholders (see ``placeholder.py``): decorators and ``tl.constexpr``
annotations work at definition time, and launching a kernel raises RuntimeError.
"""

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    from vllm.triton_utils.placeholder import tl, triton

    HAS_TRITON = False

__all__ = ["HAS_TRITON", "tl", "triton"]
