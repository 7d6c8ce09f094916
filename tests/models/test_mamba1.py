"""MambaForCausalLM and FalconMambaForCausalLM against transformers' own models, on tiny
random checkpoints saved with save_pretrained (fp32 on CPU: the conv kernels under the
Triton interpreter, the selective scan through its fp32 reference), and the batch
invariants of our model: a mixed step == each sequence alone, chunked prefill == one
prefill. GPU cases are marked.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.hybrid_utils import (
    check_bad_config_refused,
    check_loads_every_hf_weight,
    hf_greedy,
    record_figure,
    save_checkpoint,
    tokens,
)
from tests.models.mamba1_utils import dummy_config, fake_cuda_ops_with_out, make_hf
from tests.models.mamba2_utils import (
    BF16,
    BF16_ERROR_VS_HF_BF16,
    Driver,
    Row,
    assert_close,
    hf_prefill_then_decode,
    install_custom_ops,
)
from vllm import LLM, SamplingParams
from vllm.model_executor.layers.mamba.ops.causal_conv1d import NULL_BLOCK_ID
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.mamba import FalconMambaForCausalLM, MambaForCausalLM
from vllm.worker.cache_engine import CacheEngine

CLASSES = {"mamba": MambaForCausalLM, "falcon_mamba": FalconMambaForCausalLM}


@pytest.fixture(scope="module", params=list(CLASSES))
def hf_and_dir(request, tmp_path_factory):
    hf = make_hf(request.param, seed=len(request.param))
    path = save_checkpoint(hf, tmp_path_factory.mktemp(request.param))
    return request.param, hf, path


def test_loads_every_hf_weight_by_name(hf_and_dir):
    kind, hf, path = hf_and_dir
    model = check_loads_every_hf_weight(path, hf, CLASSES[kind])
    assert type(model) is CLASSES[kind]
    mixer = model.backbone.layers[0].mixer
    assert mixer.time_step_rank == hf.config.time_step_rank  # "auto" resolved as HF does
    assert (mixer.bcdt_rms_eps is None) == (kind == "mamba")
    tied = model.lm_head.weight is model.backbone.embeddings.weight
    assert tied == hf.config.tie_word_embeddings


def test_prefill_logits_match_hf(hf_and_dir, device):
    """One step of three fresh prompts (a varlen batch) against HF, prompt by prompt."""
    _, hf, path = hf_and_dir
    driver = Driver(get_model(path, device=device))
    prompts = [tokens(17, "p0"), tokens(6, "p1"), tokens(1, "p2")]
    ours = driver.step([Row(slot, p) for slot, p in zip((3, 7, 5), prompts, strict=True)])
    for prompt, logits in zip(prompts, ours, strict=True):
        expected, _ = hf_prefill_then_decode(hf, prompt, [])
        assert_close(logits, expected, "vs_hf", msg=f"prompt of {len(prompt)} tokens")


def test_decode_steps_match_hf_cache(hf_and_dir, device):
    """Two prompts, then three decode steps of both: logits and the pool's states vs HF's
    cached decode."""
    _, hf, path = hf_and_dir
    model = get_model(path, device=device)
    prompts = {1: tokens(9, "d0"), 4: tokens(4, "d1")}
    nexts = {1: tokens(3, "n0"), 4: tokens(3, "n1")}
    driver = Driver(model)
    first = driver.step([Row(slot, p) for slot, p in prompts.items()])
    got = {slot: [logits[-1:]] for slot, logits in zip(prompts, first, strict=True)}
    for k in range(3):
        out = driver.step([Row(slot, [nexts[slot][k]], True) for slot in prompts])
        for slot, logits in zip(prompts, out, strict=True):
            got[slot].append(logits)
    for slot, prompt in prompts.items():
        expected, cache = hf_prefill_then_decode(hf, prompt, nexts[slot])
        assert_close(torch.cat(got[slot]), expected[len(prompt) - 1 :], "vs_hf", msg=f"slot {slot}")
        for layer in range(model.config.num_hidden_layers):
            conv, ssm = driver.pool.layer(layer)
            assert ssm.shape[1:] == (64, 8)  # (d_inner, d_state): Mamba1's state
            assert_close(ssm[slot].cpu(), cache.ssm_state(layer)[0], "vs_hf")
            # HF's conv cache keeps W columns, the last W-1 are ours
            assert_close(conv[slot].cpu(), cache.conv_state(layer)[0][:, 1:], "vs_hf")


def test_generate_matches_hf_greedy(hf_and_dir):
    """``LLM(dir).generate``: prompts of several lengths together under a 16-token budget
    (chunked prefills beside decodes) give HF generate's greedy tokens."""
    _, hf, path = hf_and_dir
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        enforce_eager=True,
    )
    prompts = [tokens(n, "gen", n) for n in (3, 21, 9, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 5), f"{len(prompt)} tokens"
    assert llm.engine.scheduler.kv is None  # no attention layer: no KV cache


# The mixed step: history first (each sequence alone), then one step with all rows.
HISTORY = {"cont": (1, 7), "dec_a": (2, 5), "dec_b": (4, 9)}  # name: (slot, prefix length)
MIXED = {
    "fresh": (6, 11, False),
    "cont": (1, 6, True),
    "dec_a": (2, 1, True),
    "dec_b": (4, 1, True),
}
ORDERS = {
    "decodes_first": ["dec_a", "dec_b", "pad1", "fresh", "cont", "pad3"],
    "shuffled": ["fresh", "dec_a", "pad3", "cont", "pad1", "dec_b"],  # a token permutation
}
PADS = {"pad1": 1, "pad3": 3}  # padded rows (on the null line): a one-token one, a longer one


@pytest.mark.parametrize(
    "order, backend", [("shuffled", "triton"), ("decodes_first", "cuda_standin")]
)
def test_mixed_step_equals_each_sequence_alone(order, backend, monkeypatch, device):
    calls: list[str] = []
    if backend == "cuda_standin":
        install_custom_ops(monkeypatch, fake_cuda_ops_with_out(calls))
    monkeypatch.setenv("VLLM_USE_TRITON_CONV1D", "0" if backend == "cuda_standin" else "1")
    model = get_model(dummy_config(), load_format="dummy", seed=2, device=device)
    mixed, alone = Driver(model, num_slots=6), Driver(model, num_slots=6)
    for drv in (mixed, alone):
        for seq, (slot, n) in HISTORY.items():
            drv.step([Row(slot, tokens(n, "hist", seq))])
    before = mixed.pool.clone()
    rows = []
    for seq in ORDERS[order]:
        if seq in PADS:
            rows.append(Row(NULL_BLOCK_ID, tokens(PADS[seq], seq)))
        else:
            slot, n, init = MIXED[seq]
            rows.append(Row(slot, tokens(n, "new", seq), init))
    calls.clear()
    got = mixed.step(rows)
    if backend == "cuda_standin":  # the decode stream (2 decodes, the 1-token pad), 2 prefills
        assert sorted(calls) == ["fwd:17"] * 2 + ["update:3"] * 2
    for row, logits in zip(rows, got, strict=True):
        if row.slot == NULL_BLOCK_ID:
            assert torch.isfinite(logits).all()
            continue
        assert_close(logits, alone.step([row])[0], "batching", msg=f"slot {row.slot}")
    for layer in range(model.config.num_hidden_layers):
        (conv, ssm), (conv_alone, ssm_alone) = mixed.pool.layer(layer), alone.pool.layer(layer)
        conv_before, ssm_before = before.layer(layer)
        for slot in (6, 1, 2, 4):
            assert_close(conv[slot], conv_alone[slot], "batching")
            assert_close(ssm[slot], ssm_alone[slot], "batching")
        for line in (0, 3, 5):  # the null line padded rows point at, and free slots
            assert torch.equal(conv[line], conv_before[line])
            assert torch.equal(ssm[line], ssm_before[line])


def test_chunked_prefill_equals_one_prefill(device):
    model = get_model(dummy_config("mamba"), load_format="dummy", seed=1, device=device)
    prompt = tokens(19, "chunked")
    whole = Driver(model)
    expected = whole.step([Row(2, prompt)])[0]
    split = Driver(model)
    got, start = [], 0
    for n in (5, 1, 9, 4):  # a one-token continuation among them (it takes the decode path)
        got.append(split.step([Row(2, prompt[start : start + n], start > 0)])[0])
        start += n
    assert_close(torch.cat(got), expected, "batching")
    for layer in range(model.config.num_hidden_layers):
        for part in (0, 1):  # conv state, SSM state
            assert_close(
                split.pool.layer(layer)[part][2], whole.pool.layer(layer)[part][2], "batching"
            )


def test_ssm_cache_dtype_and_replay_refusal():
    """``mamba_ssm_cache_dtype`` sets the SSM pool's dtype; replayed decode (Mamba2 only)
    is refused naming the option."""
    model = get_model(dummy_config(), load_format="dummy")
    kwargs = dict(num_slots=2, block_size=4, device=torch.device("cpu"))
    cache = CacheEngine(model, ssm_dtype=torch.float16, **kwargs)
    conv, ssm = model.backbone.layers[1].mixer.kv_cache
    assert ssm.dtype == torch.float16 and ssm.shape == (3, 64, 8) and conv.shape == (3, 64, 3)
    assert cache.mamba_pool.nbytes() == 2 * 3 * 64 * (8 * 2 + 3 * 4)
    with pytest.raises(ValueError, match="use_replayssm .* serves Mamba2 layers only"):
        CacheEngine(model, ssm_dtype=torch.float32, replayssm_buffer_len=4, **kwargs)


def test_dummy_weights_from_a_config_run_through_the_engine():
    llm = LLM(dummy_config(), load_format="dummy", device="cpu", max_num_seqs=2, max_model_len=32)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.engine.config.served_model_name == "falcon_mamba"


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(conv_kernel=9), "conv_kernel=9 is not supported"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(time_step_rank=0), "time_step_rank must be a positive integer"),
        (dict(architectures=["LlamaForCausalLM"], model_type="llama"), "unsupported model"),
    ],
    ids=["conv", "act", "dt_rank", "arch"],
)
def test_bad_configs(hf_and_dir, tmp_path, edit, match):
    _, _, path = hf_and_dir
    check_bad_config_refused(path, tmp_path, edit, match)


def test_tp_check_names_the_field():
    cfg = dummy_config()  # intermediate_size 64
    cfg.check_tp(2)
    with pytest.raises(ValueError, match=r"intermediate_size \(expand \* hidden_size\)=64"):
        cfg.check_tp(3)


def check_bf16_tracks_hf(kind: str, path, device: str, **shape) -> None:
    """bf16 weights and activations: our logits of a prefill and three decode steps vs
    HF's fp32 logits of the same weights, within the bf16 bounds and at most
    BF16_ERROR_VS_HF_BF16 x HF's own bf16 error."""
    hf32 = make_hf(kind, seed=11, **shape)
    save_checkpoint(hf32, path)
    hf16 = make_hf(kind, seed=11, **shape).to(torch.bfloat16)
    driver = Driver(get_model(path, dtype="bfloat16", device=device))
    prompt, nexts = tokens(19, "bf16-prompt"), tokens(3, "bf16-next")
    got = [driver.step([Row(1, prompt)])[0]]
    got += [driver.step([Row(1, [t], True)])[0] for t in nexts]
    got = torch.cat(got)
    expected, _ = hf_prefill_then_decode(hf32, prompt, nexts)
    hf_bf16, _ = hf_prefill_then_decode(hf16, prompt, nexts)
    if device == "cpu":
        # The fixed bf16 table holds at the tiny CPU shape; at the GPU's mid-size shape the
        # random weights' bf16 rounding alone can exceed it (HF's own bf16 run does), so
        # there HF's bf16 error is the yardstick, as for the hybrids (hybrid_utils).
        assert_close(got, expected, "vs_hf", BF16)
    ours_err = (got - expected).abs().max().item()
    hf_err = (hf_bf16.float() - expected).abs().max().item()
    record_figure(
        f"{kind} bf16 on {device}: max |ours - hf_fp32| = {ours_err:.4f}, "
        f"max |hf_bf16 - hf_fp32| = {hf_err:.4f} (ratio {ours_err / max(hf_err, 1e-12):.2f})"
    )
    assert ours_err <= BF16_ERROR_VS_HF_BF16 * hf_err, (ours_err, hf_err)


@pytest.mark.parametrize("residual_in_fp32", [True, False])
def test_bf16_logits_track_hf_cpu(residual_in_fp32, monkeypatch, tmp_path):
    """On the CPU the conv runs through its fp32 references (the interpreter's bf16
    arithmetic is wrong), the residual stream in fp32 or in bf16 as the config says."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kind = "falcon_mamba" if residual_in_fp32 else "mamba"
    check_bf16_tracks_hf(kind, tmp_path / kind, "cpu", residual_in_fp32=residual_in_fp32)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(CLASSES))
def test_bf16_logits_track_hf_gpu(kind, tmp_path):
    """A mid-size shape (hidden 256, state 16, 4 layers) in bf16 on the GPU."""
    shape = dict(hidden_size=256, state_size=16, num_hidden_layers=4)
    check_bf16_tracks_hf(kind, tmp_path / kind, "cuda", **shape)
