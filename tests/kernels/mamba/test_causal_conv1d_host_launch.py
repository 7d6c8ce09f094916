"""How the launch plans behind a repeated eager call (causal_conv1d_host.py) launch.

The direct launch passes the compiled kernel exactly what the launch cache would (checked
on the CPU against Triton's own CudaLauncher, with the compiled kernel replaced by a
recorder); precompile blocks, the interpreter's miss counting and unaligned pointers keep
their behaviour; on a GPU warm calls bypass the launch cache. Also the step metadata's
builder (one aligned copy on CUDA, the tile map on random steps).
"""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.mamba.ops import causal_conv1d as ops
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
    compute_causal_conv1d_metadata,
)
from vllm.triton_utils import launch as launch_mod

from . import conv_error_cases as errors
from .conv_utils import (
    assert_close,
    gen_for,
    i32,
    make_bias,
    make_pool,
    make_weight,
    make_x,
    qsl_from_lens,
    randn,
)

FP32 = torch.float32
gpu = pytest.mark.gpu

pytestmark = pytest.mark.usefixtures("fresh_plans")


# --- launches ---------------------------------------------------------------------------


def test_precompile_block_records_and_does_not_launch(device):
    """Inside precompile() a warm plan records its variants and runs nothing."""
    kw = errors.update_kwargs(device)
    causal_conv1d_update(**kw)
    pool_before = kw["conv_state"].clone()
    with launch_mod.precompile() as report:
        causal_conv1d_update(**kw)
    assert torch.equal(kw["conv_state"], pool_before), "a launch ran inside precompile()"
    assert report.variants.get("_causal_conv1d_decode_kernel", 0) >= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter bookkeeping: CPU runs only")
def test_interpreter_launches_skip_the_launch_key(monkeypatch):
    """Under the interpreter a plan keys (and counts) a variant once; later launches of it
    call the kernel without the launch cache's key."""
    calls = {"key": 0}
    launcher = ops._LAUNCH_DECODE
    real_key = launcher.key

    def counting_key(*args, **kwargs):
        calls["key"] += 1
        return real_key(*args, **kwargs)

    monkeypatch.setattr(launcher, "key", counting_key)
    kw = errors.update_kwargs("cpu")
    for _ in range(4):
        causal_conv1d_update(**kw)
    assert calls["key"] == 1


class _Recorder:
    """Stands in for a compiled kernel's launcher: records every call."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def _fake_compiled(with_c_entry: bool):
    """A compiled kernel whose launch only records. With ``with_c_entry`` it is Triton's
    own CudaLauncher (its __call__ is what the launch cache calls) around a recording C
    entry point."""

    class Compiled:
        function = 0xF00
        packed_metadata = (4, 1, 0)

        def _init_handles(self):
            pass

    compiled = Compiled()
    if with_c_entry:
        from triton.backends.nvidia.driver import CudaLauncher

        run = object.__new__(CudaLauncher)
        run.launch = _Recorder()
        run.global_scratch_size = run.profile_scratch_size = 0
        run.global_scratch_align = run.profile_scratch_align = 1
        run.launch_cooperative_grid, run.launch_pdl, run.num_ctas = False, False, 1
        compiled.run = run
        compiled.record = run.launch
    else:
        compiled.run = compiled.record = _Recorder()
    return compiled


class _FakeKernel:
    """The JIT function: ``kernel[grid](*args, **constexprs)`` returns the fake compiled."""

    def __init__(self, real, compiled):
        self.arg_names = real.arg_names
        self.compiled = compiled

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.compiled


def _as_pointers(values):
    return [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values]


CASES = ["decode", "spec", "varlen", "fn_meta", "fn_nometa"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="emulates a GPU on the CPU")
@pytest.mark.parametrize("with_c_entry", [True, False], ids=["c_entry", "run"])
@pytest.mark.parametrize("case", CASES)
def test_direct_launch_matches_the_launch_cache(case, with_c_entry, monkeypatch):
    """A plan's direct launch passes the compiled kernel the same grid, stream, pointers,
    ints and constexprs as the launch cache's own launch of the same call."""
    g = gen_for("direct", case)
    dim, width = 64, 4
    weight, bias = make_weight(dim, width, FP32, "cpu", g), make_bias(dim, FP32, "cpu", g)
    pool = make_pool(9, dim, width - 1 + 2, FP32, "cpu", g)
    idx = i32([4, PAD_SLOT_ID, 1, 7], "cpu")
    if case.startswith("fn"):
        launcher = ops._LAUNCH_FWD
        lens = (5, 1, 2, 1)
        x = make_x(dim, sum(lens), FP32, "cpu", g)
        qsl = qsl_from_lens(lens, "cpu")
        meta = compute_causal_conv1d_metadata(qsl.cpu(), "cpu") if case == "fn_meta" else None
        init = torch.tensor([True, False, True, True])

        def call():
            return causal_conv1d_fn(x, weight, bias, pool, qsl, idx, init, metadata=meta)
    else:
        launcher = ops._LAUNCH_DECODE if case == "decode" else ops._LAUNCH_UPDATE
        acc = qsl = None
        if case == "decode":
            x = randn((4, dim), g, FP32, "cpu")
        elif case == "spec":
            x = randn((4, 3, dim), g, FP32, "cpu").transpose(1, 2)
            acc = i32([1, 2, 3, 1], "cpu")
        else:
            x = randn((7, dim), g, FP32, "cpu")
            qsl = qsl_from_lens((2, 0, 4, 1), "cpu")

        def call():
            return causal_conv1d_update(x, pool, weight, bias, "silu", idx, acc, qsl, 4)

    compiled = _fake_compiled(with_c_entry)
    stream = 0x5EA
    monkeypatch.setattr(launcher, "kernel", _FakeKernel(launcher.kernel, compiled))
    monkeypatch.setattr(launcher, "direct", True)
    monkeypatch.setattr(launcher, "cache", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": stream})
    )
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: stream, raising=False)
    monkeypatch.setattr(ops, "_use_kernel", lambda x: True)

    # The first call goes through the launch cache: a miss, "compiled" by the fake kernel.
    general = []
    real_call = type(launcher).__call__

    def spy(self, grid, args, constexprs, variants=None):
        general.append((grid, args, constexprs))
        return real_call(self, grid, args, constexprs, variants)

    monkeypatch.setattr(type(launcher), "__call__", spy)
    call()
    assert len(general) == 1 and not compiled.record.calls  # the miss launched via kernel[grid]
    grid, args, constexprs = general[0]
    assert launcher.key(args, constexprs) in launcher.cache
    # The launch cache's own launch of those arguments (its hit path) ...
    real_call(launcher, grid, args, constexprs)
    assert len(compiled.record.calls) == 1
    expected = compiled.record.calls[0]
    # ... and the plan's direct launch of the same call, which must not use the cache.
    out = call()
    assert len(general) == 1, "the second call went through the launch cache"
    assert len(compiled.record.calls) == 2
    got = compiled.record.calls[1]
    # The two calls have their own outputs: put the second one's pointer in the expected.
    out_index = {"fn_meta": 8, "fn_nometa": 8, "decode": 5}.get(case, 7)  # out's argument
    assert args[out_index].shape == out.shape
    tail = launcher.kernel.arg_names[len(args) :]
    prefix = len(expected) - len(args) - len(tail)
    exp = _as_pointers(expected)
    exp[prefix + out_index] = out.data_ptr()
    assert list(got) == exp


# --- GPU: the direct path is the one taken --------------------------------------------------


@gpu
@pytest.mark.parametrize("case", ["decode", "fn_meta"])
def test_gpu_warm_calls_bypass_the_launch_cache(case, monkeypatch, nan_poison):
    """After the first call, calls of the layout launch directly (the launch cache is not
    called) and are right; a call with an unaligned pointer takes the launch cache."""
    g = gen_for("gpu-direct", case)
    dim, width = 2064, 4
    bf16 = torch.bfloat16
    weight, bias = make_weight(dim, width, bf16, "cuda", g), make_bias(dim, bf16, "cuda", g)
    pool = make_pool(16, dim, width - 1, torch.bfloat16, "cuda", g)
    idx = i32([3, 9, PAD_SLOT_ID, 12, 0], "cuda")
    wide = randn((6, dim + 8), g, torch.bfloat16, "cuda")
    if case == "decode":
        launcher = ops._LAUNCH_DECODE
        x_aligned, x_unaligned = wide[:5, :dim], wide[:5, 1 : 1 + dim]

        def run(x, p):
            return causal_conv1d_update(x, p, weight, bias, "silu", idx)

        def ref(x, p):
            return causal_conv1d_update_ref(x, p, weight, bias, "silu", idx)
    else:
        launcher = ops._LAUNCH_FWD
        lens = (2, 1, 1, 1, 1)
        qsl = qsl_from_lens(lens, "cuda")
        meta = compute_causal_conv1d_metadata(qsl.cpu(), "cuda")
        init = torch.tensor([True, True, False, True, True], device="cuda")
        x_aligned, x_unaligned = wide[:, :dim].t(), wide[:, 1 : 1 + dim].t()

        def run(x, p):
            return causal_conv1d_fn(x, weight, bias, p, qsl, idx, init, metadata=meta)

        def ref(x, p):
            return causal_conv1d_ref(x, weight, bias, p, qsl, idx, init)

    run(x_aligned, pool.clone())  # builds the plan, takes the compiled kernel
    used = []
    real_call = type(launcher).__call__

    def spy(self, *args, **kwargs):
        used.append(1)
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(type(launcher), "__call__", spy)
    for x, via_cache in ((x_aligned, False), (x_unaligned, True)):
        used.clear()
        p, rp = pool.clone(), pool.clone()
        out = run(x, p)
        expected = ref(x, rp)
        torch.cuda.synchronize()
        assert bool(used) == via_cache
        assert_close(out, expected)
        assert torch.equal(p, rp)


@gpu
def test_gpu_metadata_one_aligned_copy():
    """On CUDA the offsets and the tile map come from one copy, each view 16-byte aligned."""
    for lens in [(1,), (3, 0, 7, 1), (1,) * 5, (100, 1, 1, 1, 1, 1, 1, 64)]:
        qsl = qsl_from_lens(lens, "cpu")
        meta = compute_causal_conv1d_metadata(qsl, "cuda")
        assert meta.query_start_loc.data_ptr() % 16 == 0
        assert meta.tile_seq.data_ptr() % 16 == 0
        assert meta.tile_seq.untyped_storage().data_ptr() == (
            meta.query_start_loc.untyped_storage().data_ptr()
        )
        assert meta.query_start_loc.cpu().tolist() == qsl.tolist()
        starts = qsl[:-1].tolist()
        for p, b in enumerate(meta.tile_seq.cpu().tolist()):
            assert starts[b] <= p * meta.block_t < starts[b] + lens[b]


def test_metadata_random_steps():
    """The numpy builder against the definition on random steps (empty sequences, one
    sequence, steps past the small-step tile length)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        batch = int(torch.randint(0, 40, (1,), generator=g))
        lens = torch.randint(0, 3 if trial % 3 else 3000, (batch,), generator=g).tolist()
        qsl = qsl_from_lens(lens, "cpu")
        meta = compute_causal_conv1d_metadata(qsl, "cpu")
        num_tokens = sum(lens)
        assert (meta.num_tokens, meta.batch_size) == (num_tokens, batch)
        assert meta.max_query_len == (max(lens) if lens else 0)
        assert meta.block_t == ops._fwd_block_t(num_tokens)
        starts = qsl[:-1].tolist()
        expected = [
            max(b for b, s in enumerate(starts) if s <= p * meta.block_t)
            for p in range(-(-num_tokens // meta.block_t))
        ]
        assert meta.tile_seq.dtype == torch.int32
        assert meta.tile_seq.tolist() == expected
