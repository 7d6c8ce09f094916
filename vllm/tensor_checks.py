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


def check_conv_weight_bias(weight, bias, dim, device, dtypes) -> int:
    """Conv ``weight`` (dim, W) with 2 <= W <= 8 and ``stride(1) == 1``, ``bias`` (dim,) or
    None, both on ``device`` with a dtype in ``dtypes``; returns W."""
    check_tensor("weight", weight, device, 2, dtypes)
    width = weight.shape[1]
    if weight.shape[0] != dim:
        raise ValueError(f"weight must be (dim={dim}, width), got {tuple(weight.shape)}")
    if not MIN_CONV_WIDTH <= width <= MAX_CONV_WIDTH:
        raise ValueError(
            f"weight width must be in [{MIN_CONV_WIDTH}, {MAX_CONV_WIDTH}], got {width}"
        )
    if weight.stride(1) != 1:
        raise ValueError(f"weight must have stride(1) == 1, got strides {weight.stride()}")
    if bias is not None:
        check_tensor("bias", bias, device, 1, dtypes)
        if bias.shape[0] != dim:
            raise ValueError(f"bias must be (dim={dim},), got {tuple(bias.shape)}")
    return width


def check_default_lines(name, indices, batch, num_lines) -> None:
    """With ``indices`` None, sequence b uses cache line b: the pool needs ``batch`` lines."""
    if indices is None and batch > num_lines:
        raise ValueError(
            f"{name} is None, so sequence b uses line b, but batch={batch} > "
            f"num_cache_lines={num_lines}"
        )


def check_scan_shapes(x, dt, A, B, C, D, dt_bias) -> None:
    """Shapes of the selective scan's inputs (see ``ops/mamba_ssm_torch``): x (tokens, nheads,
    headdim), dt (tokens, nheads), B and C (tokens, ngroups, dstate), A, D, dt_bias (nheads,)."""
    if x.dim() != 3:
        raise ValueError(f"x must be (num_tokens, nheads, headdim), got {tuple(x.shape)}")
    n, nheads, _ = x.shape
    if tuple(dt.shape) != (n, nheads):
        raise ValueError(f"dt must be (num_tokens={n}, nheads={nheads}), got {tuple(dt.shape)}")
    if B.dim() != 3 or B.shape[0] != n or B.shape != C.shape:
        raise ValueError(
            f"B and C must be (num_tokens={n}, ngroups, dstate) alike, got {tuple(B.shape)} "
            f"and {tuple(C.shape)}"
        )
    if nheads % B.shape[1]:
        raise ValueError(f"nheads={nheads} must be a multiple of ngroups={B.shape[1]}")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t is not None and tuple(t.shape) != (nheads,):
            raise ValueError(f"{name} must be (nheads={nheads},), got {tuple(t.shape)}")


def check_state_update_shapes(state, x, dt, A, B, C, D, dt_bias, state_batch_indices, out) -> None:
    """Shapes of ``selective_state_update``'s arguments, whichever path runs it."""
    check_scan_shapes(x, dt, A, B, C, D, dt_bias)
    batch, nheads, headdim = x.shape
    dstate = B.shape[2]
    if state.dim() != 4 or tuple(state.shape[1:]) != (nheads, headdim, dstate):
        raise ValueError(
            f"state must be (num_lines, {nheads}, {headdim}, {dstate}), got {tuple(state.shape)}"
        )
    if out is not None and out.shape != x.shape:
        raise ValueError(f"out must be shaped like x {tuple(x.shape)}, got {tuple(out.shape)}")
    if state_batch_indices is None:
        if batch > state.shape[0]:
            raise ValueError(f"batch={batch} > num_lines={state.shape[0]} without indices")
    elif tuple(state_batch_indices.shape) != (batch,):
        raise ValueError(
            f"state_batch_indices must be (batch={batch},), got {tuple(state_batch_indices.shape)}"
        )
