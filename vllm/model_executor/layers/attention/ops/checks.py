"""Host-side argument checks of the attention ops, shared by the Triton launchers and the
PyTorch references.

They read shapes, strides, dtypes and devices only (never device data), so they cost no
sync and are safe inside CUDA-graph capture. Every failure is a ValueError naming the
argument.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_SIZE = 256


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, device, ndim: int, dtypes, ref: str) -> None:
    """``t`` is a tensor with ``ndim`` dims, a dtype in ``dtypes``, on ``device`` (that of
    the argument named ``ref``)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but {ref} is on {device}")


def check_optional_hint(name: str, value, upper: int | None = None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
    if upper is not None and value > upper:
        raise ValueError(f"{name}={value} exceeds {upper}")


def check_kv_cache(
    kv_cache, device, num_kv_heads: int | None, head_size: int | None, ref: str
) -> None:
    """kv_cache is (2, num_blocks, block_size, num_kv_heads, head_size), stride 1 along
    head_size, on ``device`` (that of the argument named ``ref``)."""
    check_tensor("kv_cache", kv_cache, device, 5, FLOAT_DTYPES, ref)
    two, num_blocks, block_size, kvh, d = kv_cache.shape
    if two != 2 or block_size < 1 or kvh < 1 or d < 1:
        raise ValueError(
            "kv_cache must be (2, num_blocks, block_size, num_kv_heads, head_size) with "
            f"index 0 = K and 1 = V, got shape {tuple(kv_cache.shape)}"
        )
    if num_kv_heads is not None and kvh != num_kv_heads:
        raise ValueError(f"kv_cache has {kvh} kv heads, expected num_kv_heads={num_kv_heads}")
    if head_size is not None and d != head_size:
        raise ValueError(f"kv_cache has head_size {d}, expected {head_size}")
    if d > 1 and kv_cache.stride(4) != 1:
        raise ValueError(f"kv_cache must have stride 1 along head_size, got {kv_cache.stride()}")


def check_unified_attention_args(
    q,
    kv_cache,
    out,
    query_start_loc,
    seq_lens,
    block_table,
    scale,
    num_decodes,
    max_query_len,
    max_seq_len,
) -> None:
    """Every host-visible property of ``unified_attention``'s arguments (see its module)."""
    check_tensor("q", q, None, 3, FLOAT_DTYPES, "q")
    num_tokens, num_heads, head_size = q.shape
    device = q.device
    if num_heads < 1 or head_size < 1:
        raise ValueError(f"q must be (num_tokens, num_heads, head_size), got {tuple(q.shape)}")
    if head_size > MAX_HEAD_SIZE:
        raise ValueError(f"head_size must be <= {MAX_HEAD_SIZE}, got {head_size}")
    if head_size > 1 and q.stride(2) != 1:
        raise ValueError(f"q must have stride 1 along head_size, got strides {q.stride()}")
    check_tensor("out", out, device, 3, FLOAT_DTYPES, "q")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(
            f"out must match q: shape {tuple(q.shape)} dtype {q.dtype}, got shape "
            f"{tuple(out.shape)} dtype {out.dtype}"
        )
    if head_size > 1 and out.stride(2) != 1:
        raise ValueError(f"out must have stride 1 along head_size, got strides {out.stride()}")
    check_kv_cache(kv_cache, device, None, head_size, "q")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must equal q's dtype {q.dtype}")
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} (q) must be a multiple of num_kv_heads={num_kv_heads} "
            "(kv_cache)"
        )
    i32 = (torch.int32,)
    check_tensor("query_start_loc", query_start_loc, device, 1, i32, "q")
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must have num_seqs+1 >= 1 entries")
    num_seqs = query_start_loc.shape[0] - 1
    check_tensor("seq_lens", seq_lens, device, 1, i32, "q")
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"seq_lens must have num_seqs={num_seqs} entries (query_start_loc has "
            f"{num_seqs + 1}), got {seq_lens.shape[0]}"
        )
    check_tensor("block_table", block_table, device, 2, i32, "q")
    if block_table.shape[0] != num_seqs:
        raise ValueError(
            f"block_table must have num_seqs={num_seqs} rows, got shape {tuple(block_table.shape)}"
        )
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table rows must be contiguous, got strides {block_table.stride()}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float, got {type(scale).__name__}")
    if not (float(scale) == float(scale) and abs(float(scale)) != float("inf")):
        raise ValueError(f"scale must be finite, got {scale}")
    check_optional_hint("num_decodes", num_decodes, num_seqs)
    check_optional_hint("max_query_len", max_query_len)
    check_optional_hint("max_seq_len", max_seq_len)


def check_reshape_and_cache_args(key, value, kv_cache, slot_mapping) -> None:
    """key/value (num_tokens, num_kv_heads, head_size) alike; slot_mapping (num_tokens,) int64."""
    check_tensor("key", key, None, 3, FLOAT_DTYPES, "key")
    device = key.device
    check_tensor("value", value, device, 3, FLOAT_DTYPES, "key")
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(
            f"value must match key: shape {tuple(key.shape)} dtype {key.dtype}, got shape "
            f"{tuple(value.shape)} dtype {value.dtype}"
        )
    num_tokens, num_kv_heads, head_size = key.shape
    for name, t in (("key", key), ("value", value)):
        if head_size > 1 and t.stride(2) != 1:
            raise ValueError(f"{name} must have stride 1 along head_size, got {t.stride()}")
    check_kv_cache(kv_cache, device, num_kv_heads, head_size, "key")
    check_tensor("slot_mapping", slot_mapping, device, 1, (torch.int64,), "key")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping must have num_tokens={num_tokens} entries, got {slot_mapping.shape[0]}"
        )
