"""GPU-only model tests: backends agree, no host sync in a step, the 7B-shaped mixed step.

(bf16 parity with HF is ``test_mamba2_hf_parity.py::test_bf16_logits_track_hf[cuda]``; the
CPU model tests also run on the GPU box, on CUDA tensors.) These need the CUDA conv ops
built (``vllm._custom_ops``) for the backend-0 cases: a missing build fails them.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from tests.models.mamba2_utils import BF16, FP32, TINY, Driver, Row, assert_close, gen_for
from vllm.model_executor.layers.mamba.ops.causal_conv1d import PAD_SLOT_ID
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

pytestmark = pytest.mark.gpu

PAD = PAD_SLOT_ID
DTYPE_IDS = {FP32: "fp32", BF16: "bf16"}


def model_for(backend: str, monkeypatch, config, dtype, seed=0):
    monkeypatch.setenv("VLLM_USE_TRITON_CONV1D", "1" if backend == "triton" else "0")
    return get_model(config, load_format="dummy", dtype=dtype, device="cuda", seed=seed)


def toks(n, key, vocab=TINY["vocab_size"]):
    return torch.randint(0, vocab, (n,), generator=gen_for(key)).tolist()


# Steps of several sequences at different stages, rows deliberately out of canonical order.
STEPS = [
    [Row(7, toks(37, "a")), Row(3, toks(5, "b")), Row(PAD, toks(1, "p"))],
    [Row(3, toks(1, "c"), True), Row(7, toks(9, "d"), True), Row(5, toks(300, "e"))],
    [
        Row(PAD, toks(4, "q")),
        Row(5, toks(1, "f"), True),
        Row(7, toks(1, "g"), True),
        Row(3, toks(1, "h"), True),
        Row(PAD, toks(1, "r")),
    ],
    [Row(7, toks(1, "i"), True), Row(3, toks(1, "j"), True), Row(5, toks(1, "k"), True)],
]


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=lambda d: DTYPE_IDS[d])
def test_triton_and_cuda_backends_agree(dtype, monkeypatch):
    cfg = Mamba2ModelConfig(
        **{
            **TINY,
            "hidden_size": 128,
            "num_heads": 8,
            "head_dim": 32,
            "n_groups": 2,
            "state_size": 16,
            "chunk_size": 64,
        }
    )
    drivers = {
        name: Driver(model_for(name, monkeypatch, cfg, dtype), num_slots=8)
        for name in ("triton", "cuda")
    }
    for k, rows in enumerate(STEPS):
        out = {name: drv.step(rows) for name, drv in drivers.items()}
        for i, row in enumerate(rows):
            if row.slot != PAD:
                assert_close(out["cuda"][i], out["triton"][i], "backends", dtype, f"step {k}")
    for layer in range(cfg.num_hidden_layers):
        (conv_t, ssm_t), (conv_c, ssm_c) = (d.pool.layer(layer) for d in drivers.values())
        assert_close(conv_c.float(), conv_t.float(), "backends", dtype)
        assert_close(ssm_c, ssm_t, "backends", dtype)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_no_host_sync_during_a_step(backend, monkeypatch):
    model = model_for(backend, monkeypatch, Mamba2ModelConfig(**TINY), FP32)
    drv = Driver(model)
    steps = STEPS[:3]
    drv.step(steps[0])  # compile the kernels outside the checked region
    for rows in steps[1:]:
        md = drv.build(rows)
        ids = torch.tensor([t for r in rows for t in r.tokens], device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            drv.forward(ids, md)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _time_step(model, rows, pool_slots, repeats=5):
    drv = Driver(model, num_slots=pool_slots)
    md = drv.build(rows)
    ids = torch.tensor([t for r in rows for t in r.tokens], device="cuda")
    times = []
    with torch.no_grad():
        logits = model.compute_logits(drv.forward(ids, md)[-1:]).float().cpu()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            drv.forward(ids, md)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    del drv
    return statistics.median(times), logits


@pytest.mark.gpu_big_memory
def test_codestral_7b_shaped_mixed_step_both_backends(monkeypatch, capsys):
    """Mamba-Codestral-7B shape (HF Mamba2Config defaults), dummy bf16 weights: one step of
    1 x 2048-token prefill + 63 decodes with each backend; prints the forward times. (With
    255 decodes the fp32 state pool alone took 64 GiB, and next to another 7B-shaped test
    under gpu_check's 8 pytest workers the H200 ran out of memory.)"""
    cfg = Mamba2ModelConfig()
    prompt = toks(2048, "7b-prompt", cfg.vocab_size)
    rows = [Row(64, prompt)] + [
        Row(s, toks(1, ("7b", s), cfg.vocab_size), True) for s in range(1, 64)
    ]
    results = {}
    for backend in ("triton", "cuda"):
        model = model_for(backend, monkeypatch, cfg, BF16, seed=7)
        results[backend] = _time_step(model, rows, pool_slots=64)
        del model
        torch.cuda.empty_cache()
    with capsys.disabled():
        for backend, (ms, _) in results.items():
            print(
                f"\n7B-shaped mixed step (1x2048 prefill + 63 decodes, bf16) "
                f"backend={backend}: {ms:.2f} ms (median of 5, {torch.cuda.get_device_name()})"
            )
    assert torch.isfinite(results["triton"][1]).all()
    assert_close(results["cuda"][1], results["triton"][1], "backends", BF16)
