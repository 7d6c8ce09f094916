"""Cases of Mamba1's selective scan and decode update (helpers of the test_selective_scan*
modules): random inputs drawn on the CPU (fp32, then cast), and the comparison of an op's
outputs and pool with the fp32 reference's, line by line."""

from __future__ import annotations

import dataclasses

import torch

from tests.models.mamba2_utils import FP32, assert_close, gen_for
from vllm.model_executor.layers.mamba.ops import NULL_BLOCK_ID


@dataclasses.dataclass(frozen=True)
class ScanCase:
    """A varlen batch: ``lens`` per sequence; ``lines[b]`` its pool line (a pad marker for a
    padded row); ``init[b]`` whether it starts from its line."""

    lens: tuple[int, ...]
    lines: tuple[int, ...]
    init: tuple[bool, ...]
    dim: int = 6
    dstate: int = 5
    dtype: torch.dtype = FP32
    state_dtype: torch.dtype = FP32
    num_lines: int = 8
    strided: bool = False  # u, delta, z, B, C as column slices of one wide projection
    z: bool = True
    D: bool = True
    bias: bool = True
    softplus: bool = True
    pad_slot_id: int | None = None  # None: the default marker (NULL_BLOCK_ID)
    no_indices: bool = False  # cache_indices None: sequence b on line b

    @property
    def id(self) -> str:
        parts = [
            "-".join(map(str, self.lens)),
            str(self.dtype).removeprefix("torch."),
            "pool_" + str(self.state_dtype).removeprefix("torch."),
        ]
        parts += [name for name in ("strided", "no_indices") if getattr(self, name)]
        parts += [f"no_{name}" for name in ("z", "D", "bias") if not getattr(self, name)]
        if self.pad_slot_id is not None:
            parts.append(f"pad{self.pad_slot_id}")
        return ",".join(parts)

    @property
    def marker(self) -> int:
        return NULL_BLOCK_ID if self.pad_slot_id is None else self.pad_slot_id


def rnd(*shape, key) -> torch.Tensor:
    return torch.randn(*shape, generator=gen_for("selective-scan", *key))


def _rows(case: ScanCase, n: int, widths: dict[str, int], key, device) -> dict[str, torch.Tensor]:
    """(n, width) tensors in the case's dtype on ``device``; with ``strided`` column slices of
    one wider tensor (row stride != width, unit column stride), as the layer slices
    projections (sliced on the device: moving a slice would make it contiguous)."""
    total = sum(widths.values()) + 3
    wide = rnd(n, total, key=(key, "wide"))
    if not case.softplus:  # dt is delta itself: keep it positive, the decays below 1
        at = 1 + widths["u"]
        wide[:, at : at + widths["delta"]] = 0.05 + wide[:, at : at + widths["delta"]].abs()
    wide = wide.to(case.dtype).to(device)
    out, at = {}, 1
    for name, w in widths.items():
        t = wide[:, at : at + w] if case.strided else wide[:, at : at + w].contiguous()
        out[name] = t
        at += w
    return out


def params(dim: int, dstate: int, dtype: torch.dtype, key) -> dict[str, torch.Tensor]:
    """A (negative, as -exp(A_log)), D and delta_bias."""
    A = -(0.2 + rnd(dim, dstate, key=(key, "A")).abs()).to(dtype)
    D = rnd(dim, key=(key, "D")).to(dtype)
    bias = (0.3 * rnd(dim, key=(key, "bias"))).to(dtype)
    return dict(A=A, D=D, delta_bias=bias)


def scan_inputs(case: ScanCase, device: torch.device) -> tuple[dict, torch.Tensor]:
    """The op's keyword arguments (without ssm_states) and a pool to clone for each run."""
    n = sum(case.lens)
    key = case.id
    widths = dict(u=case.dim, delta=case.dim, z=case.dim, B=case.dstate, C=case.dstate)
    rows = _rows(case, n, widths, key, device)
    p = params(case.dim, case.dstate, case.dtype, key)
    qsl = torch.tensor([0, *torch.tensor(case.lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = dict(
        u=rows["u"],
        delta=rows["delta"],
        A=p["A"],
        B=rows["B"],
        C=rows["C"],
        query_start_loc=qsl,
        cache_indices=None if case.no_indices else torch.tensor(case.lines, dtype=torch.int32),
        has_initial_state=torch.tensor(case.init, dtype=torch.bool),
        D=p["D"] if case.D else None,
        z=rows["z"] if case.z else None,
        delta_bias=p["delta_bias"] if case.bias else None,
        delta_softplus=case.softplus,
    )
    if case.pad_slot_id is not None:
        kw["pad_slot_id"] = case.pad_slot_id
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    pool = rnd(case.num_lines, case.dim, case.dstate, key=(key, "pool")).to(case.state_dtype)
    return kw, pool.to(device)


def real_lines(lines, marker: int) -> set[int]:
    return {line for line in lines if line != marker and line >= 0}


def check_against_reference(op, ref, kw: dict, pool: torch.Tensor, dtype, touched: set[int],
                            **op_kwargs) -> torch.Tensor:  # fmt: skip
    """Run ``op`` and ``ref`` on clones of ``pool``; outputs within the scan tolerance of the
    inputs' dtype, lines in ``touched`` within one store's rounding, every other line (the
    null line among them) bit-identical to before. Returns the op's output."""
    mine, theirs = pool.clone(), pool.clone()
    y = op(ssm_states=mine, **kw, **op_kwargs)
    y_ref = ref(ssm_states=theirs, **kw)
    assert y.dtype == kw["u"].dtype and y.shape == kw["u"].shape
    assert_close(y, y_ref, "scan", dtype)
    state_tol = dtype if pool.dtype == FP32 else pool.dtype
    for line in range(pool.shape[0]):
        if line in touched:
            assert_close(mine[line], theirs[line], "scan", state_tol, msg=f"line {line}")
        else:
            assert torch.equal(mine[line], pool[line]), f"line {line} was written"
    return y
