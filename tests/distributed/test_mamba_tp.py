"""The Mamba2 mixer cut by heads and groups (``mamba_tp``): its row layout against an
independent derivation, and the real ``MambaMixer2`` on two gloo ranks, its parameters
loaded from full tensors and run through a tiny mixer composed of the PyTorch reference
ops (in_proj, conv, SSM scan, gated norm, out_proj), equal to one rank, output and states,
over a prefill step and a decode step, for n_groups 1 (replicated, the norm reduces across
ranks), 2 and 4."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.utils import GPU2_SKIP_REASON, run_ranks
from tests.models.mamba2_utils import run_mixer
from vllm.distributed import get_tp_group
from vllm.model_executor.layers.layernorm import rms_norm_gated_ref
from vllm.model_executor.layers.linear import RowShards
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_tp import (
    Mixer2RMSNormGated,
    mamba2_layout,
    mamba2_tp_problems,
)
from vllm.model_executor.layers.mamba.mamba_utils import Mamba2Shape
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import (
    PAD_SLOT_ID,
    causal_conv1d_ref,
    causal_conv1d_update_ref,
)
from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import (
    chunk_scan_varlen,
    plan_chunked_scan,
    selective_state_update_torch,
)

TOL = dict(atol=1e-5, rtol=1e-5)
EPS = 1e-5
HIDDEN, HEADS, HEAD_DIM, STATE, WIDTH, CHUNK = 16, 4, 4, 8, 4, 4
SEQ_LENS = (5, 3)


def shape_of(heads=HEADS, head_dim=HEAD_DIM, state=STATE, n_groups=1) -> Mamba2Shape:
    return Mamba2Shape(
        hidden_size=HIDDEN,
        num_heads=heads,
        head_dim=head_dim,
        n_groups=n_groups,
        state_size=state,
        conv_kernel=WIDTH,
        chunk_size=CHUNK,
        use_bias=True,
        use_conv_bias=True,
        norm_eps=EPS,
        time_step_limit=(0.0, math.inf),
    )


# -- the row layout --------------------------------------------------------------------


def _rank_heads(heads: int, tp: int, rank: int) -> torch.Tensor:
    n = heads // tp
    return torch.arange(rank * n, (rank + 1) * n)


def _expected_rows(heads, head_dim, state, groups, tp, rank, with_z_dt=True) -> torch.Tensor:
    """The checkpoint rows of in_proj (or, without z and dt, of conv1d) rank ``rank``
    needs, derived from the whole layer's split: its heads' channels, the groups those
    heads read."""
    inter, gn = heads * head_dim, groups * state
    z, x, B, C, dt = torch.arange(2 * inter + 2 * gn + heads).split([inter, inter, gn, gn, heads])
    if not with_z_dt:
        x, B, C = torch.arange(inter + 2 * gn).split([inter, gn, gn])
    mine = _rank_heads(heads, tp, rank)
    read = torch.unique(mine // (heads // groups))
    chan = lambda t: t.view(heads, head_dim)[mine].flatten()  # noqa: E731
    grp = lambda t: t.view(groups, state)[read].flatten()  # noqa: E731
    if not with_z_dt:
        return torch.cat([chan(x), grp(B), grp(C)])
    return torch.cat([chan(z), chan(x), grp(B), grp(C), dt[mine]])


def _loaded_rows(sizes_units, tp, rank) -> torch.Tensor:
    """Which full rows a rank's tensor holds, by loading row numbers through RowShards."""
    shards = RowShards(*sizes_units, tp_rank=rank, tp_size=tp)
    full = torch.arange(shards.full_size, dtype=torch.float32)[:, None].expand(-1, 5)
    local = torch.full((shards.local_size, 5), -1.0)
    shards.load(local, full, None, "rows")
    return local[:, 0].long()


@pytest.mark.parametrize(
    "heads, groups, tp",
    [(8, 1, 2), (8, 2, 2), (8, 4, 2), (8, 2, 4), (8, 1, 4), (8, 8, 4), (16, 2, 8)],
    ids=lambda v: str(v),
)
def test_rows_match_the_whole_layers_split(heads, groups, tp):
    shape = shape_of(heads=heads, head_dim=2, state=3, n_groups=groups)
    layout = mamba2_layout(shape, tp_size=tp)
    read_by = torch.zeros(2 * heads * 2 + 2 * groups * 3 + heads, dtype=torch.long)
    for rank in range(tp):
        got = _loaded_rows(layout["in_proj"], tp, rank)
        want = _expected_rows(heads, 2, 3, groups, tp, rank)
        assert torch.equal(got, want)
        conv = _loaded_rows(layout["conv1d"], tp, rank)
        assert torch.equal(conv, _expected_rows(heads, 2, 3, groups, tp, rank, False))
        assert torch.equal(_loaded_rows(layout["heads"], tp, rank), _rank_heads(heads, tp, rank))
        read_by[want] += 1
        local_groups = groups // tp if groups >= tp else 1
        assert conv.numel() == heads // tp * 2 + 2 * local_groups * 3  # the conv state's dim
        norm = Mixer2RMSNormGated(
            RowShards(*layout["channels"], tp_rank=rank, tp_size=tp), groups, EPS
        )
        assert (norm.shared_group is not None) == (groups < tp)
        if groups < tp:  # the one group this rank's heads read
            assert norm.shared_group == rank // (tp // groups)
    # every row is read; with groups split, by one rank; replicated B and C by tp / G
    assert bool((read_by >= 1).all())
    bc = slice(4 * heads, 4 * heads + 6 * groups)
    assert bool((read_by[bc] == max(1, tp // groups)).all())
    assert read_by.sum() - read_by[bc].sum() == read_by.numel() - 6 * groups


@pytest.mark.parametrize(
    "heads, groups, tp, match",
    [
        (6, 3, 2, "n_groups=3 neither divides tp_size=2"),
        (6, 1, 4, "num_heads=6 is not divisible by tp_size=4"),
        (4, 4, 3, "num_heads=4 is not divisible by tp_size=3; n_groups=4 neither"),
    ],
    ids=["groups_3_tp_2", "heads_6_tp_4", "both"],
)
def test_layers_that_cannot_align_are_refused(heads, groups, tp, match):
    assert match.split("; ")[0] in "; ".join(mamba2_tp_problems(heads, groups, tp))
    with pytest.raises(ValueError, match=match):
        mamba2_layout(shape_of(heads=heads, head_dim=2, state=3, n_groups=groups), tp_size=tp)


# -- the tiny mixer --------------------------------------------------------------------


def full_params(n_groups: int, device) -> dict[str, torch.Tensor]:
    """HF-named full tensors of a tiny mixer with the scales of a trained one."""
    g = torch.Generator().manual_seed(n_groups)
    inter, conv_dim = HEADS * HEAD_DIM, HEADS * HEAD_DIM + 2 * n_groups * STATE
    u = lambda *shape, lo=-1.0, hi=1.0: torch.rand(*shape, generator=g) * (hi - lo) + lo  # noqa: E731
    dt = u(HEADS, lo=-3.0, hi=-0.7).exp()  # 0.05 .. 0.5: states that matter
    p = {
        "in_proj.weight": u(2 * inter + 2 * n_groups * STATE + HEADS, HIDDEN) * HIDDEN**-0.5,
        "in_proj.bias": u(2 * inter + 2 * n_groups * STATE + HEADS) * 0.1,
        "conv1d.weight": u(conv_dim, 1, WIDTH) * 0.5,
        "conv1d.bias": u(conv_dim) * 0.1,
        "A_log": u(HEADS, lo=0.0, hi=1.5),
        "D": u(HEADS, lo=0.5, hi=1.5),
        "dt_bias": dt + torch.log(-torch.expm1(-dt)),
        "norm.weight": u(inter, lo=0.8, hi=1.2),
        "out_proj.weight": u(HIDDEN, inter) * inter**-0.5,
        "out_proj.bias": u(HIDDEN) * 0.1,
    }
    return {k: v.to(device) for k, v in p.items()}


def mixer_steps(p, in_proj, norm, out_proj, heads, groups, conv_state, ssm_state, inputs):
    """A prefill of SEQ_LENS tokens, then one decode token per sequence: the outputs of
    both steps; updates the states. ``p``: conv and SSM parameters (whole or one rank's)."""
    inter, gn = heads * HEAD_DIM, groups * STATE
    w, b = p["conv1d.weight"].squeeze(1), p["conv1d.bias"]
    A = -torch.exp(p["A_log"])
    scan = dict(D=p["D"], dt_bias=p["dt_bias"], dt_softplus=True)
    # Sequence i on line i, line 0 included: the references get pad_slot_id=PAD_SLOT_ID.
    slots = torch.arange(len(SEQ_LENS), dtype=torch.int32, device=conv_state.device)
    pad = dict(pad_slot_id=PAD_SLOT_ID)

    def split(xbc, dt):
        x, B, C = xbc.split([inter, gn, gn], dim=-1)
        by_group = (groups, STATE)
        return (
            x.unflatten(-1, (heads, HEAD_DIM)),
            B.unflatten(-1, by_group),
            C.unflatten(-1, by_group),
            dt,
        )

    outs = []
    prefill, decode = inputs
    z, xbc, dt = in_proj(prefill).split([inter, inter + 2 * gn, heads], dim=-1)
    qsl = torch.tensor([0, SEQ_LENS[0], sum(SEQ_LENS)], dtype=torch.int32, device=slots.device)
    no_init = torch.zeros(len(SEQ_LENS), dtype=torch.bool, device=slots.device)
    xbc = causal_conv1d_ref(xbc.t(), w, b, conv_state, qsl, slots, no_init, "silu", **pad).t()
    x, B, C, dt = split(xbc, dt)
    layout = plan_chunked_scan(torch.tensor(SEQ_LENS), CHUNK).to(slots.device)
    y, final = chunk_scan_varlen(x, dt, A, B, C, layout, **scan)
    ssm_state[: len(SEQ_LENS)] = final
    outs.append(out_proj(norm(y.flatten(1), z)))

    z, xbc, dt = in_proj(decode).split([inter, inter + 2 * gn, heads], dim=-1)
    xbc = causal_conv1d_update_ref(xbc, conv_state, w, b, "silu", slots, **pad)
    x, B, C, dt = split(xbc, dt)
    y = selective_state_update_torch(
        ssm_state, x, dt, A, B, C, state_batch_indices=slots, **scan, **pad
    )
    outs.append(out_proj(norm(y.flatten(1), z)))
    return outs


def _inputs(device):
    g = torch.Generator().manual_seed(100)
    n = sum(SEQ_LENS)
    return torch.randn(n, HIDDEN, generator=g).to(device), torch.randn(2, HIDDEN, generator=g).to(
        device
    )


def run_unsharded(n_groups: int, device):
    p = full_params(n_groups, device)
    conv_dim = HEADS * HEAD_DIM + 2 * n_groups * STATE
    conv_state = torch.zeros(len(SEQ_LENS) + 1, conv_dim, WIDTH - 1, device=device)
    ssm_state = torch.zeros(len(SEQ_LENS) + 1, HEADS, HEAD_DIM, STATE, device=device)
    group_size = HEADS * HEAD_DIM // n_groups
    outs = mixer_steps(
        p,
        lambda h: F.linear(h, p["in_proj.weight"], p["in_proj.bias"]),
        lambda y, z: rms_norm_gated_ref(y, z, p["norm.weight"], EPS, group_size),
        lambda y: F.linear(y, p["out_proj.weight"], p["out_proj.bias"]),
        HEADS,
        n_groups,
        conv_state,
        ssm_state,
        _inputs(device),
    )
    return outs, conv_state, ssm_state


def load_mixer(mixer: MambaMixer2, full: dict[str, torch.Tensor]) -> None:
    """Every parameter from its full (HF-layout) tensor, through its own weight_loader."""
    for name, tensor in full.items():
        param = mixer.get_parameter(name)
        param.weight_loader(param, tensor)


@torch.no_grad()
def _sharded_equals_unsharded() -> None:
    tp = get_tp_group()
    dev, rank = tp.device, tp.rank
    for n_groups in (1, 2, 4):
        want, conv_full, ssm_full = run_unsharded(n_groups, dev)
        full = full_params(n_groups, dev)
        with torch.device(dev):
            mixer = MambaMixer2(shape_of(n_groups=n_groups))
        load_mixer(mixer, full)
        assert mixer.num_heads == HEADS // 2
        assert mixer.n_groups == max(1, n_groups // 2)
        assert (mixer.norm.shared_group is not None) == (n_groups == 1)
        p = {
            name: mixer.get_parameter(name)
            for name in ("conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias")
        }
        p["conv1d.weight"] = p["conv1d.weight"].unsqueeze(1)
        conv_state = torch.zeros(len(SEQ_LENS) + 1, *mixer.spec.conv_shape, device=dev)
        ssm_state = torch.zeros(len(SEQ_LENS) + 1, *mixer.spec.ssm_shape, device=dev)
        got = mixer_steps(
            p,
            mixer.in_proj,
            mixer.norm,
            mixer.out_proj,
            mixer.num_heads,
            mixer.n_groups,
            conv_state,
            ssm_state,
            _inputs(dev),
        )
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"G={n_groups} step {step}: {m}")  # noqa: B023
        # this rank's state lines are the whole layer's state at its rows and heads
        rows = _expected_rows(HEADS, HEAD_DIM, STATE, n_groups, 2, rank, with_z_dt=False)
        torch.testing.assert_close(conv_state, conv_full[:, rows.to(dev)], **TOL)
        heads = _rank_heads(HEADS, 2, rank).to(dev)
        torch.testing.assert_close(ssm_state, ssm_full[:, heads], **TOL)
        # the norm alone: replicated groups reduce across ranks, split groups do not
        y = torch.randn(3, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(7)).to(dev)
        zg = torch.randn(3, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(8)).to(dev)
        whole = rms_norm_gated_ref(y, zg, full["norm.weight"], EPS, HEADS * HEAD_DIM // n_groups)
        c = slice(rank * mixer.intermediate_size, (rank + 1) * mixer.intermediate_size)
        torch.testing.assert_close(mixer.norm(y[:, c], zg[:, c]), whole[:, c], **TOL)


@pytest.mark.timeout(120)
def test_two_rank_mixer_equals_one_rank_gloo():
    run_ranks(_sharded_equals_unsharded, world_size=2, backend="gloo")


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=GPU2_SKIP_REASON)
def test_two_rank_mixer_equals_one_rank_nccl():
    run_ranks(_sharded_equals_unsharded, world_size=2, backend="nccl")


@torch.no_grad()
def test_the_composed_reference_is_the_real_mixer():
    """The one-rank composition above computes what MambaMixer2 computes (its kernels under
    the interpreter on CPU), so the layout mamba_tp shards is the layer's."""
    from vllm.model_executor.layers.mamba.mamba2_metadata import Mamba2MetadataBuilder
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStatePool

    n_groups = 2
    want, conv_want, ssm_want = run_unsharded(n_groups, "cpu")
    mixer = MambaMixer2(shape_of(n_groups=n_groups))
    load_mixer(mixer, full_params(n_groups, "cpu"))
    pool = MambaStatePool(mixer.spec, 1, len(SEQ_LENS), mixer.backend, torch.float32)
    builder = Mamba2MetadataBuilder(CHUNK, "cpu")
    slots = torch.arange(1, len(SEQ_LENS) + 1, dtype=torch.int32)  # line 0: the null line
    prefill, decode = _inputs("cpu")
    qsl = torch.tensor([0, SEQ_LENS[0], sum(SEQ_LENS)], dtype=torch.int32)
    md = builder.build(qsl, slots, torch.zeros(len(SEQ_LENS), dtype=torch.bool))
    got = [run_mixer(mixer, prefill, pool.layer(0), md)]
    md = builder.build(torch.arange(3, dtype=torch.int32), slots, torch.ones(2, dtype=torch.bool))
    got.append(run_mixer(mixer, decode, pool.layer(0), md))
    # the kernels sum in another order than the references: a looser bound than TOL
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    conv, ssm = pool.layer(0)
    torch.testing.assert_close(conv[1:], conv_want[: len(SEQ_LENS)], **TOL)
    torch.testing.assert_close(ssm[1:], ssm_want[: len(SEQ_LENS)], atol=1e-4, rtol=1e-4)
