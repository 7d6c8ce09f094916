"""The fused-MoE op: route, group the (token, k) pairs by expert, two grouped GEMMs.

``fused_experts(x, w13, w2, topk_weights, topk_ids)`` computes, for every token t,
``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` where expert e is
``W2[e] (act(W_gate[e] x) * W_up[e] x)`` with ``w13[e] = [W_gate; W_up]`` (2I, H) and
``w2[e]`` (H, I), or ``W2[e] act(W13[e] x)`` with ``w13[e]`` (I, H) when
``is_act_and_mul`` is False. ``fused_moe`` adds the router (``router.select_experts``).

Steps, all on the device with no host sync (the launches depend on shapes only, so a
decode step is CUDA-graph safe): ``moe_align_block_size`` (pairs sorted by expert, padded
per expert to BLOCK_M: one kernel launch for small steps, torch ops for large ones; none
for steps of at most ``align.max_unsorted_pairs`` pairs, E // 4 by default, where each
pair is a block of its own), one launch of ``moe_gate_up_kernel`` (gate and up GEMMs with
the activation fused), one of ``moe_down_kernel`` (down GEMM with the routing weight
fused, a row per pair), one of ``moe_sum_kernel`` (the top-k sum; none for top_k == 1).
Why no atomics, and the GEMMs' grid order (``GROUP_SIZE_M``): ``fused_moe_kernels``'
docstring.

Tensors: ``x`` (tokens, H) fp32/fp16/bf16, the weights in x's dtype, ``topk_weights``
(tokens, top_k) float, ``topk_ids`` (tokens, top_k) int32/int64 in [0, E). Launch
configurations come from ``configs/fused_moe/`` (``vllm.triton_utils.configs``), keyed by
a bucket of the token count. CUDA tensors run the kernels, CPU tensors run them under
``TRITON_INTERPRET=1`` and the fp32 reference (``fused_moe_ref``) otherwise.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from vllm.model_executor.layers.fused_moe.fused_moe_kernels import (
    ACTIVATIONS,
    moe_down_kernel,
    moe_gate_up_kernel,
    moe_sum_kernel,
)
from vllm.model_executor.layers.fused_moe.fused_moe_ref import fused_experts_ref
from vllm.model_executor.layers.fused_moe.moe_align import (
    INDEX_DTYPES,
    MAX_KERNEL_PAIRS,
    moe_align_block_size,
)
from vllm.model_executor.layers.fused_moe.router import select_experts
from vllm.tensor_checks import FLOAT_DTYPES, check_tensor
from vllm.triton_utils import configs, triton
from vllm.triton_utils.host import recording
from vllm.triton_utils.launch import CachedLauncher

__all__ = ["fused_experts", "fused_moe", "launch_config"]

CONFIG_DIR = Path(__file__).parent / "configs" / "fused_moe"
# Token counts the launch tables are keyed by: a batch takes the first >= it (else the last).
TOKEN_BUCKETS = (1, 16, 64, 256, 1024, 4096)

_GATE_UP = CachedLauncher(moe_gate_up_kernel)
_DOWN = CachedLauncher(moe_down_kernel)
_SUM = CachedLauncher(moe_sum_kernel)


def use_moe_kernel(x: torch.Tensor) -> bool:
    """CUDA tensors run the kernels; CPU tensors only under the interpreter."""
    return x.is_cuda or (x.device.type == "cpu" and _GATE_UP.runs_cpu_tensors())


def token_bucket(num_tokens: int) -> int:
    return next((b for b in TOKEN_BUCKETS if b >= num_tokens), TOKEN_BUCKETS[-1])


def launch_config(
    num_tokens: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype
) -> dict:
    """The table's entry for this shape and token bucket: BLOCK_M (rows per block, shared by
    the alignment and both GEMMs), BLOCK_N, BLOCK_K, num_warps, num_stages, optional
    GROUP_SIZE_M (the grid order, 1 by default) and MASK_ROWS (padding rows load nothing;
    by default for BLOCK_M <= 64) for the gate/up GEMM, optional ``down`` and
    ``sum`` dicts overriding them for the other launches, an optional ``align`` dict
    (``max_kernel_pairs``, ``num_warps``: ``moe_align``; ``max_unsorted_pairs``). The
    most specific key found wins (E, H, I, dtype and bucket; dtype and bucket; bucket)."""
    return _config(token_bucket(num_tokens), num_experts, hidden, inter, dtype)


@functools.cache  # a lookup builds keys and walks the tables: not per launch
def _config(bucket: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> dict:
    keys = [
        configs.table_key(E=num_experts, H=hidden, I=inter, dtype=dtype, tokens=bucket),
        configs.table_key(dtype=dtype, tokens=bucket),
        configs.table_key(tokens=bucket),
    ]
    return _check_entry(configs.lookup_first(CONFIG_DIR, keys), keys[0])


def _check_entry(cfg: dict, key: str) -> dict:
    """``cfg`` if its tiles and warp counts are what Triton takes (powers of two), else a
    ValueError naming the entry's shape and the field (a hand-edited table)."""
    parts = [("", cfg)] + [
        (f"{p}.", cfg[p]) for p in ("down", "sum") if isinstance(cfg.get(p), dict)
    ]
    for prefix, own in parts:
        for field in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps"):
            v = own.get(field)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1)
            ):
                raise ValueError(
                    f"fused-MoE launch table ({CONFIG_DIR}) entry for {key}: {prefix}{field} "
                    f"must be a power of two, got {v!r}"
                )
    if "BLOCK_M" not in cfg:
        raise ValueError(f"fused-MoE launch table ({CONFIG_DIR}) entry for {key}: no BLOCK_M")
    return cfg


def _tile(size: int, block: int) -> int:
    """A power-of-two tile no larger than the dimension needs, at least 16 (tl.dot's)."""
    return max(16, min(int(block), triton.next_power_of_2(size)))


def _launch_options(cfg: dict) -> dict:
    out = {"num_warps": int(cfg.get("num_warps", 4))}
    if "num_stages" in cfg:
        out["num_stages"] = int(cfg["num_stages"])
    return out


def _gemm_constexprs(cfg: dict, part: str, n: int, k: int) -> dict:
    own = {**cfg, **cfg.get(part, {})}
    block_k = _tile(k, own["BLOCK_K"])
    block_m = max(16, int(cfg["BLOCK_M"]))
    return dict(
        GROUP_SIZE_M=max(1, int(own.get("GROUP_SIZE_M", 1))),
        MASK_ROWS=mask_rows(cfg, part),
        BLOCK_M=block_m,
        BLOCK_N=_tile(n, own["BLOCK_N"]),
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,  # the K loop's loads need no mask
        **_launch_options(own),
    )


def mask_rows(cfg: dict, part: str) -> bool:
    """Whether the ``part`` GEMM's padding rows load nothing: the entry's MASK_ROWS (its
    part dict over its top level), else on for BLOCK_M <= 64."""
    own = {**cfg, **cfg.get(part, {})}
    return bool(own.get("MASK_ROWS", max(16, int(cfg["BLOCK_M"])) <= 64))


def max_unsorted_pairs(cfg: dict, num_experts: int) -> int:
    """Steps of at most this many pairs skip the alignment (``UNSORTED``): the table's
    ``align.max_unsorted_pairs``, else E // 4 (upstream's rule: so few pairs that few
    share an expert, whose weights a block per pair would read once per pair)."""
    return int(cfg.get("align", {}).get("max_unsorted_pairs", num_experts // 4))


def _unsorted(cfg: dict, topk_ids: torch.Tensor, num_experts: int) -> bool:
    """One block per pair, ``topk_ids`` read as the blocks' experts: a tiny step whose ids
    are int32, contiguous and 16-byte aligned (the alignment's own buffers are, so both
    paths launch the same compiled kernels), and not inside ``precompile()``, which records
    the sorted path to register the alignment kernel too."""
    return (
        topk_ids.numel() <= max_unsorted_pairs(cfg, num_experts)
        and topk_ids.dtype == torch.int32
        and topk_ids.is_contiguous()
        and topk_ids.data_ptr() % 16 == 0
        and not recording()
    )


def _sum_constexprs(cfg: dict, top_k: int, hidden: int) -> dict:
    own = cfg.get("sum", {})
    block = min(int(own.get("BLOCK_N", 1024)), triton.next_power_of_2(hidden))
    return dict(TOP_K=top_k, BLOCK_N=block, num_warps=int(own.get("num_warps", 4)))


def _check(x, w13, w2, topk_weights, topk_ids, activation, is_act_and_mul) -> None:
    device = x.device
    check_tensor("x", x, device, 2, FLOAT_DTYPES)
    check_tensor("w13", w13, device, 3, (x.dtype,))
    check_tensor("w2", w2, device, 3, (x.dtype,))
    check_tensor("topk_weights", topk_weights, device, 2, FLOAT_DTYPES)
    check_tensor("topk_ids", topk_ids, device, 2, INDEX_DTYPES)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    tokens, hidden = x.shape
    num_experts, w2_hidden, inter = w2.shape
    rows = 2 * inter if is_act_and_mul else inter
    if w2_hidden != hidden:
        raise ValueError(
            f"x has hidden size {hidden} but w2 {tuple(w2.shape)} is (E, hidden={w2_hidden}, I)"
        )
    if tuple(w13.shape) != (num_experts, rows, hidden):
        what = "2 * I" if is_act_and_mul else "I"
        raise ValueError(
            f"w13 must be (E={num_experts}, {what}={rows}, hidden={hidden}) for w2 of shape "
            f"{tuple(w2.shape)} (is_act_and_mul={is_act_and_mul}), got {tuple(w13.shape)}"
        )
    if topk_ids.shape[0] != tokens or topk_ids.shape[1] < 1:
        raise ValueError(
            f"topk_ids must be (num_tokens={tokens}, top_k), got {tuple(topk_ids.shape)}"
        )
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights must be shaped like topk_ids {tuple(topk_ids.shape)}, "
            f"got {tuple(topk_weights.shape)}"
        )
    if topk_ids.shape[1] > num_experts:
        raise ValueError(f"topk_ids has top_k={topk_ids.shape[1]} > E={num_experts} experts")


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    is_act_and_mul: bool = True,
) -> torch.Tensor:
    """The experts' weighted sum per token (the module docstring); (tokens, H) in x's dtype."""
    _check(x, w13, w2, topk_weights, topk_ids, activation, is_act_and_mul)
    if not use_moe_kernel(x):
        return fused_experts_ref(x, w13, w2, topk_weights, topk_ids, activation, is_act_and_mul)
    tokens, hidden = x.shape
    num_experts, _, inter = w2.shape
    top_k = topk_ids.shape[1]
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    cfg = launch_config(tokens, num_experts, hidden, inter, x.dtype)
    up = _gemm_constexprs(cfg, "gate_up", inter, hidden)
    down = _gemm_constexprs(cfg, "down", hidden, inter)
    num_pairs = topk_ids.numel()
    unsorted = _unsorted(cfg, topk_ids, num_experts)
    if unsorted:  # block p is pair p: no alignment launch
        sorted_ids = expert_ids = topk_ids.view(-1)
    else:
        max_pairs, align_warps = _align_options(cfg)
        sorted_ids, expert_ids, _ = moe_align_block_size(
            topk_ids,
            up["BLOCK_M"],
            num_experts,
            max_pairs,
            align_warps,
            _align_variants(num_experts, hidden, inter, x.dtype),
        )
    # Read by pair id, so with unit stride (reshape can return a strided view, e.g. of a
    # one-token slice). fp32 or x's dtype.
    weights = topk_weights.contiguous().view(-1)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = out if top_k == 1 else torch.empty(tokens, top_k, hidden, dtype=x.dtype, device=x.device)
    y2 = y.view(num_pairs, hidden)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    num_blocks = expert_ids.shape[0]
    shape = (num_experts, hidden, inter, top_k, x.dtype)

    args = (x, w13, h, sorted_ids, expert_ids, num_pairs, num_blocks, hidden, inter, top_k,
            *x.stride(), *w13.stride(), *h.stride())  # fmt: skip
    cx = dict(IS_ACT_AND_MUL=bool(is_act_and_mul), ACTIVATION=ACTIVATIONS[activation],
              DOT_PRECISION=precision, UNSORTED=unsorted, **up)  # fmt: skip
    grid = (num_blocks * triton.cdiv(inter, up["BLOCK_N"]),)
    _GATE_UP(grid, args, cx, _variants(cx, "gate_up", *shape))

    args = (h, w2, y2, weights, sorted_ids, expert_ids, num_pairs, num_blocks, hidden, inter,
            *h.stride(), *w2.stride(), *y2.stride())  # fmt: skip
    cx = dict(DOT_PRECISION=precision, UNSORTED=unsorted, **down)
    grid = (num_blocks * triton.cdiv(hidden, down["BLOCK_N"]),)
    _DOWN(grid, args, cx, _variants(cx, "down", *shape))

    if top_k > 1:
        cx = _sum_constexprs(cfg, top_k, hidden)
        args = (y, out, hidden, *y.stride(), *out.stride())
        _SUM((tokens, triton.cdiv(hidden, cx["BLOCK_N"])), args, cx, None)
    return out


def _align_options(cfg: dict) -> tuple[int, int]:
    align = cfg.get("align", {})
    return int(align.get("max_kernel_pairs", MAX_KERNEL_PAIRS)), int(align.get("num_warps", 4))


@functools.cache
def _align_variants(num_experts, hidden, inter, dtype) -> tuple[tuple[int, int], ...]:
    """(BLOCK_M, num_warps) of the alignment kernel at every bucket of the table."""
    out = set()
    for bucket in TOKEN_BUCKETS:
        cfg = launch_config(bucket, num_experts, hidden, inter, dtype)
        out.add((max(16, int(cfg["BLOCK_M"])), _align_options(cfg)[1]))
    return tuple(sorted(out))


def _variants(given: dict, part: str, num_experts, hidden, inter, top_k, dtype):
    """Every constexpr set the table can pick for this launch site (``precompile``): each
    bucket's tiles, sorted, and unsorted too where a step of the bucket can be that small
    (its fewest tokens, the previous bucket's plus one, have few enough pairs)."""

    def variants() -> list[dict]:
        seen = {}
        fewest = 1
        for bucket in TOKEN_BUCKETS:
            cfg = launch_config(bucket, num_experts, hidden, inter, dtype)
            n, k = (inter, hidden) if part == "gate_up" else (hidden, inter)
            small = fewest * top_k <= max_unsorted_pairs(cfg, num_experts)
            for unsorted in (False, True) if small else (False,):
                c = {**given, **_gemm_constexprs(cfg, part, n, k), "UNSORTED": unsorted}
                seen[tuple(sorted(c.items()))] = c
            fewest = bucket + 1
        return list(seen.values())

    return variants


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    activation: str = "silu",
    is_act_and_mul: bool = True,
    **router_options,
) -> torch.Tensor:
    """``select_experts(router_logits, top_k, **router_options)`` then ``fused_experts``."""
    if router_logits.dim() != 2 or router_logits.shape[0] != x.shape[0]:
        raise ValueError(
            f"router_logits must be (num_tokens={x.shape[0]}, E), got {tuple(router_logits.shape)}"
        )
    weights, ids = select_experts(router_logits, top_k, **router_options)
    return fused_experts(x, w13, w2, weights, ids, activation, is_act_and_mul)
