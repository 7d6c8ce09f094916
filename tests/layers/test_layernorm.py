"""The Triton norms (``layernorm_triton``) against the PyTorch references of ``layernorm``.

On CPU the kernel runs under the interpreter (fp32 and fp16), once with the interpreter's
blocks of rows per program and once with the GPU's one row per program; the ``gpu`` cases
add bf16 and the Codestral-7B widths. Rows come as strided views where the model hands them so
(the gate is a column slice of the in_proj output).
"""

from __future__ import annotations

import pytest
import torch

from tests.models.mamba2_utils import BF16, FP16, FP32, gen_for
from vllm.model_executor.layers import layernorm_triton
from vllm.model_executor.layers.layernorm import (
    RMSNorm,
    RMSNormGated,
    rms_norm_gated_ref,
    rms_norm_ref,
)
from vllm.model_executor.layers.layernorm_triton import rms_norm_triton

TOL = {FP32: (1e-5, 1e-5), FP16: (2e-3, 2e-3), BF16: (1.6e-2, 1.6e-2)}
NAMES = {FP32: "fp32", FP16: "fp16", BF16: "bf16"}

CPU_CASES = [
    # rows, hidden, groups, x dtype, weight dtype, residual dtype
    (5, 64, 1, FP32, FP32, FP32),
    (3, 96, 3, FP16, FP16, FP32),
    (4, 8200, 2, FP32, FP32, FP32),  # groups of 4100 > one block: the two-pass walk
    (1, 40, 4, FP16, FP32, FP16),
    (0, 32, 1, FP32, FP32, FP32),
    (37, 256, 2, FP32, FP32, FP16),  # the interpreter's row blocks: 32 rows, then 5
]
GPU_CASES = [
    (2048, 4096, 1, BF16, BF16, FP32),  # the Codestral block norm: bf16 x, fp32 residual
    (257, 8192, 8, BF16, BF16, FP32),  # its gated norm: groups of 1024
    (3, 8192, 1, BF16, BF16, BF16),  # one group of 8192 (Bamba-like), two passes
]


def _id(case) -> str:
    rows, hidden, groups, xd, wd, rd = case
    return f"R{rows}_D{hidden}_G{groups}_x{NAMES[xd]}_w{NAMES[wd]}_res{NAMES[rd]}"


def _inputs(case, device, key):
    rows, hidden, groups, xd, wd, rd = case
    g = gen_for("layernorm", key, _id(case))
    wide = torch.randn(rows, 3 * hidden, generator=g) * 2
    x = wide[:, hidden : 2 * hidden].to(device, xd)  # a strided view, as the model's
    z = wide[:, :hidden].to(device, xd)
    res = torch.randn(rows, hidden, generator=g).to(device, rd)
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(device, wd)
    return x, z, res, w


def _close(got, want, dtype):
    atol, rtol = TOL[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def _check(case, device):
    rows, hidden, groups, xd, wd, rd = case
    x, z, res, w = _inputs(case, device, "plain")
    out_dtype = BF16 if BF16 in (xd, wd) else FP16 if FP16 in (xd, wd) else FP32
    _close(rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), out_dtype)

    res_k, res_r = res.clone(), res.clone()
    y_k = rms_norm_triton(x, w, 1e-5, residual=res_k)
    y_r, _ = rms_norm_ref(x, w, 1e-5, res_r)
    _close(y_k, y_r, out_dtype)
    _close(res_k, res_r, rd)  # the residual stream, updated in place in its own dtype

    group = hidden // groups
    got = rms_norm_triton(x, w, 1e-5, gate=z, group_size=group)
    _close(got, rms_norm_gated_ref(x, z, w, 1e-5, group), out_dtype)


@pytest.mark.parametrize("rows_per_program", ["block", "one"])
@pytest.mark.parametrize("case", CPU_CASES, ids=_id)
def test_norms_match_reference(case, rows_per_program, device, nan_poison, monkeypatch):
    rows, hidden, groups, xd = case[:4]
    if rows_per_program == "one":  # the GPU's launch: one row per program
        monkeypatch.setattr(layernorm_triton, "_INTERPRETER_TILE", 1)
    cfg = layernorm_triton._config(hidden // groups, xd.itemsize, device.type == "cpu")
    if device.type == "cuda" or rows_per_program == "one" or not cfg["SINGLE_PASS"]:
        assert cfg["ROWS"] == 1
    else:  # the blocks of rows are what this case runs
        assert cfg["ROWS"] == 4096 // cfg["BLOCK"] > 1
    _check(case, device)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_id)
def test_norms_match_reference_gpu(case, nan_poison):
    _check(case, torch.device("cuda"))


def test_modules_use_the_kernel_path(device):
    """The modules give the references' results on their own dispatch (kernel on CUDA and
    under the interpreter), and take the fused add when handed a residual."""
    norm = RMSNorm(48, eps=1e-6).to(device)
    gated = RMSNormGated(48, group_size=12, eps=1e-6).to(device)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        gated.weight.uniform_(0.5, 1.5)
    x, z, res, _ = _inputs((6, 48, 4, FP32, FP32, FP32), device, "module")
    _close(norm(x), rms_norm_ref(x, norm.weight, 1e-6), FP32)
    r1, r2 = res.clone(), res.clone()
    y, r_out = norm(x, r1)
    assert r_out is r1
    _close(y, rms_norm_ref(x, norm.weight, 1e-6, r2)[0], FP32)
    _close(r1, r2, FP32)
    _close(gated(x, z), rms_norm_gated_ref(x, z, gated.weight, 1e-6, 12), FP32)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(group_size=7), "group_size"),
        (dict(residual="shape"), "residual must be"),
        (dict(gate="shape", residual="ok"), "not both"),
    ],
    ids=["bad_group", "bad_residual", "gate_and_residual"],
)
def test_bad_arguments(kwargs, match, device):
    x = torch.randn(4, 32, device=device)
    w = torch.ones(32, device=device)
    given = {}
    for k, v in kwargs.items():
        if v == "shape":
            given[k] = torch.randn(4, 16, device=device)
        elif v == "ok":
            given[k] = torch.randn(4, 32, device=device)
        else:
            given[k] = v
    with pytest.raises(ValueError, match=match):
        rms_norm_triton(x, w, 1e-5, **given)
