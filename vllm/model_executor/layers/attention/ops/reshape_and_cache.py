"""Write a step's keys and values into the paged KV cache.

For every token t with ``slot = slot_mapping[t] >= 0``::

    kv_cache[0, slot // block_size, slot % block_size] = key[t]
    kv_cache[1, slot // block_size, slot % block_size] = value[t]

cast to the cache's dtype. Tokens with a negative slot are padding: nothing is read for
them and the cache is untouched. Only the named slots change; two tokens naming the same
slot is a caller bug (which one lands is unspecified).

Tensors (logical shapes; the stride that must be 1 in brackets):

- ``key``, ``value``: (num_tokens, num_kv_heads, head_size) [head_size], same dtype;
  other strides free (views into a fused QKV projection are fine).
- ``kv_cache``: (2, num_blocks, block_size, num_kv_heads, head_size) [head_size], any of
  fp32/fp16/bf16. Mutated in place.
- ``slot_mapping``: (num_tokens,) int64, ``block * block_size + offset`` or < 0.

The grid is (num_tokens, pieces of num_kv_heads * head_size), from shapes only, and
nothing syncs, so the op can be captured in a CUDA graph. Slots are not range-checked on
the device (the metadata builder checks the block tables it is given); the torch path
checks them. On CPU tensors the torch path ``reshape_and_cache_ref`` runs unless
``TRITON_INTERPRET=1``.
"""

import torch

from vllm.model_executor.layers.attention.ops.checks import check_reshape_and_cache_args
from vllm.triton_utils import HAS_TRITON, tl, triton
from vllm.triton_utils.launch import CachedLauncher

__all__ = ["reshape_and_cache", "reshape_and_cache_ref"]


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    slot_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kv_kv,
    stride_kv_blk,
    stride_kv_slot,
    stride_kv_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + i_t)
    # Flattened (head, dim) elements of this token, BLOCK per program.
    o_e = i_p * BLOCK + tl.arange(0, BLOCK)
    o_h = o_e // HEAD_SIZE
    o_d = o_e % HEAD_SIZE
    m_e = (o_e < NUM_KV_HEADS * HEAD_SIZE) & (slot >= 0)
    blk = tl.where(slot >= 0, slot, 0) // BLOCK_SIZE
    off = tl.where(slot >= 0, slot, 0) % BLOCK_SIZE
    p_dst = kv_ptr + blk * stride_kv_blk + off * stride_kv_slot + o_h * stride_kv_h + o_d
    b_k = tl.load(key_ptr + i_t * stride_key_t + o_h * stride_key_h + o_d, mask=m_e)
    b_v = tl.load(value_ptr + i_t * stride_value_t + o_h * stride_value_h + o_d, mask=m_e)
    tl.store(p_dst, b_k.to(kv_ptr.dtype.element_ty), mask=m_e)
    tl.store(p_dst + stride_kv_kv, b_v.to(kv_ptr.dtype.element_ty), mask=m_e)


_LAUNCH = CachedLauncher(_reshape_and_cache_kernel)
_MAX_BLOCK = 1024  # elements (heads x dims) of one token per program


def reshape_and_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The torch path (CPU, and the tests' oracle): same contract, and it checks that every
    non-negative slot lies inside the cache (a ValueError otherwise; this reads the slots,
    a sync on a GPU)."""
    check_reshape_and_cache_args(key, value, kv_cache, slot_mapping)
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    live = slot_mapping >= 0
    slots = slot_mapping[live]
    if slots.numel() and int(slots.max()) >= num_slots:
        raise ValueError(
            f"slot_mapping has slot {int(slots.max())} outside the cache's {num_slots} slots "
            f"({kv_cache.shape[1]} blocks of {kv_cache.shape[2]})"
        )
    flat = kv_cache.view(2, num_slots, *kv_cache.shape[3:]) if kv_cache.is_contiguous() else None
    if flat is not None:
        flat[0, slots] = key[live].to(kv_cache.dtype)
        flat[1, slots] = value[live].to(kv_cache.dtype)
        return
    block_size = kv_cache.shape[2]
    blk, off = slots // block_size, slots % block_size
    kv_cache[0, blk, off] = key[live].to(kv_cache.dtype)
    kv_cache[1, blk, off] = value[live].to(kv_cache.dtype)


def _use_kernel(key: torch.Tensor) -> bool:
    if key.is_cuda:
        if not HAS_TRITON:
            raise RuntimeError("reshape_and_cache on CUDA tensors needs Triton, which is missing")
        return True
    return _LAUNCH.runs_cpu_tensors()


def _impl(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    if not _use_kernel(key):
        reshape_and_cache_ref(key, value, kv_cache, slot_mapping)
        return
    block = min(_MAX_BLOCK, triton.next_power_of_2(num_kv_heads * head_size))
    grid = (num_tokens, triton.cdiv(num_kv_heads * head_size, block))
    args = (
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
    )
    constexprs = dict(
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK=block,
        num_warps=4 if block >= 512 else 1,
    )
    _LAUNCH(grid, args, constexprs)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key and value rows into their slots of ``kv_cache`` (see the module docstring)."""
    check_reshape_and_cache_args(key, value, kv_cache, slot_mapping)
    if torch.compiler.is_compiling():
        torch.ops.vllm.reshape_and_cache(key, value, kv_cache, slot_mapping)
    else:
        _impl(key, value, kv_cache, slot_mapping)


_reshape_and_cache_op = torch.library.custom_op(
    "vllm::reshape_and_cache", _impl, mutates_args=("kv_cache",)
)


@_reshape_and_cache_op.register_fake
def _(key, value, kv_cache, slot_mapping):
    return None
