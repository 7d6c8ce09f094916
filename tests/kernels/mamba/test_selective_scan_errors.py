"""Mamba1's selective scan and decode update: bad arguments raise a ValueError that names
the argument, and the torch.library registrations pass opcheck.

The checks run on the host before dispatch, so CPU tensors exercise them on every machine;
the ones that read index data run on CPU tensors only (where reading costs no sync)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.mamba.selective_scan_utils import ScanCase, params, rnd, scan_inputs
from vllm.model_executor.layers.mamba.ops import NULL_BLOCK_ID
from vllm.model_executor.layers.mamba.ops.selective_scan import (
    selective_scan_fn,
    selective_state_update_mamba1,
)

CPU = torch.device("cpu")
CASE = ScanCase((3, 2, 4), (2, 0, 5), (True, False, True))


def _scan_kw():
    kw, pool = scan_inputs(CASE, CPU)
    return dict(kw, ssm_states=pool)


def _col_major(t):
    return t.t().contiguous().t()


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda kw: dict(u=kw["u"][None]), "u must have 2 dims"),
        (lambda kw: dict(u=kw["u"].to(torch.int32)), "u must have dtype"),
        (lambda kw: dict(u=_col_major(kw["u"])), "u must have unit stride along dim"),
        (lambda kw: dict(delta=kw["delta"][:, :4]), r"delta must be \(num_tokens=9, dim=6\)"),
        (lambda kw: dict(z=kw["z"][:5]), "z must be"),
        (lambda kw: dict(out=kw["u"][:, :2].clone()), "out must be"),
        (lambda kw: dict(B=kw["B"][:, :3]), r"B must be \(num_tokens=9, dstate=5\)"),
        (lambda kw: dict(C=_col_major(kw["C"])), "C must have unit stride along dstate"),
        (lambda kw: dict(A=kw["A"][:4]), r"A must be \(dim=6, dstate\)"),
        (lambda kw: dict(D=kw["D"][:2]), r"D must be \(dim=6,\)"),
        (lambda kw: dict(delta_bias=kw["delta_bias"].repeat(2)[::2]), "delta_bias must be contig"),
        (lambda kw: dict(ssm_states=kw["ssm_states"][..., :4]), "ssm_states must be"),
        (lambda kw: dict(ssm_states=kw["ssm_states"].double()), "ssm_states must have dtype"),
        (lambda kw: dict(query_start_loc=kw["query_start_loc"].float()), "query_start_loc must"),
        (
            lambda kw: dict(query_start_loc=torch.tensor([0, 5, 3, 9], dtype=torch.int32)),
            "query_start_loc must be non-decreasing",
        ),
        (
            lambda kw: dict(query_start_loc=torch.tensor([0, 5, 7, 12], dtype=torch.int32)),
            "query_start_loc must be non-decreasing within",
        ),
        (lambda kw: dict(cache_indices=kw["cache_indices"][:2]), "cache_indices must have at"),
        (lambda kw: dict(cache_indices=kw["cache_indices"].float()), "cache_indices must have"),
        (
            lambda kw: dict(cache_indices=torch.tensor([2, 0, 8], dtype=torch.int32)),
            "cache_indices has entries past the 8",
        ),
        (
            lambda kw: dict(cache_indices=torch.tensor([2, 0, 2], dtype=torch.int32)),
            "cache_indices has duplicate",
        ),
        (
            lambda kw: dict(has_initial_state=kw["has_initial_state"].int()),
            "has_initial_state must have dtype",
        ),
        (lambda kw: dict(pad_slot_id=0.0), "pad_slot_id must be an int"),
        (lambda kw: dict(chunk_len=0), "chunk_len must be a positive int"),
    ],
    ids=[
        "u_dims", "u_dtype", "u_strides", "delta", "z", "out", "B", "C_strides", "A", "D",
        "bias_strided", "states_shape", "states_dtype", "qsl_dtype", "qsl_order", "qsl_end",
        "indices_short", "indices_dtype", "indices_range", "indices_repeat", "init_dtype",
        "pad", "chunk_len",
    ],
)  # fmt: skip
def test_scan_bad_arguments_raise_value_error(change, match):
    kw = _scan_kw()
    kw.update(change(kw))
    with pytest.raises(ValueError, match=match):
        selective_scan_fn(**kw)


def _update_kw(batch=3):
    p = params(6, 5, torch.float32, "upd-errors")
    rows = {n: rnd(batch, w, key=("upd-errors", n)) for n, w in
            (("u", 6), ("delta", 6), ("z", 6), ("B", 5), ("C", 5))}  # fmt: skip
    pool = rnd(4, 6, 5, key=("upd-errors", "pool"))
    idx = torch.tensor([1, 0, 3], dtype=torch.int32)
    return dict(rows, **p, ssm_states=pool, state_batch_indices=idx)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda kw: dict(delta=kw["delta"][:, :2]), r"delta must be \(batch=3, dim=6\)"),
        (lambda kw: dict(z=kw["z"][:2]), "z must be"),
        (lambda kw: dict(B=kw["B"][:, :4]), r"B must be \(batch=3, dstate=5\)"),
        (lambda kw: dict(C=kw["C"].double()), "C must have dtype"),
        (lambda kw: dict(A=kw["A"][:, :, None]), "A must have 2 dims"),
        (lambda kw: dict(ssm_states=kw["ssm_states"][0]), "ssm_states must have 3 dims"),
        (lambda kw: dict(state_batch_indices=kw["state_batch_indices"][:2]),
         r"state_batch_indices must be \(batch=3,\)"),
        (lambda kw: dict(state_batch_indices=kw["state_batch_indices"].float()),
         "state_batch_indices must have dtype"),
        (lambda kw: dict(state_batch_indices=torch.tensor([1, 4, 2], dtype=torch.int32)),
         "state_batch_indices has entries past the 4"),
        (lambda kw: dict(state_batch_indices=None, u=rnd(5, 6, key="u5"),
                         delta=rnd(5, 6, key="d5"), z=None, B=rnd(5, 5, key="b5"),
                         C=rnd(5, 5, key="c5")), "state_batch_indices is None"),
        (lambda kw: dict(pad_slot_id=None), "pad_slot_id must be an int"),
    ],
    ids=["delta", "z", "B", "C_dtype", "A_dims", "states_dims", "indices_shape",
         "indices_dtype", "indices_range", "default_lines", "pad"],
)  # fmt: skip
def test_update_bad_arguments_raise_value_error(change, match):
    kw = _update_kw()
    kw.update(change(kw))
    with pytest.raises(ValueError, match=match):
        selective_state_update_mamba1(**kw)


_CPU_KERNEL = pytest.param(
    "cpu",
    marks=pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="CPU tensors run the kernels only under the Triton interpreter, which the "
        "tests turn on only on machines without a GPU",
    ),
)


@pytest.mark.parametrize("device_name", [_CPU_KERNEL, pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck(device_name):
    device = torch.device(device_name)
    kw, pool = scan_inputs(CASE, device)
    out = torch.empty_like(kw["u"])
    scan_args = (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["query_start_loc"], pool,
                 kw["cache_indices"], kw["has_initial_state"], kw["D"], kw["z"],
                 kw["delta_bias"], True, NULL_BLOCK_ID, 2, out)  # fmt: skip
    torch.library.opcheck(torch.ops.vllm.mamba1_selective_scan.default, scan_args)
    u = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in _update_kw().items()}
    upd_args = (u["ssm_states"], u["u"], u["delta"], u["A"], u["B"], u["C"], u["D"], u["z"],
                u["delta_bias"], True, u["state_batch_indices"], NULL_BLOCK_ID,
                torch.empty_like(u["u"]))  # fmt: skip
    torch.library.opcheck(torch.ops.vllm.mamba1_state_update.default, upd_args)
