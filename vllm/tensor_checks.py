"""Host-side argument checks shared by the op wrappers (Triton ops and CUDA ops).

They read shapes, strides, dtypes and devices only, never device data, so they cost no
sync; each failure is a ValueError that names the argument.
"""

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_CONV_WIDTH, MAX_CONV_WIDTH = 2, 8


def check_tensor(name, t, device, ndim=None, dtypes=None) -> None:
    """``t`` is a tensor on ``device`` (x's) with ``ndim`` dims and a dtype in ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}")
