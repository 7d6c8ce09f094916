"""Helpers of the hybrid-model tests (Bamba, NemotronH, Zamba2): tiny HF checkpoints made
with transformers' own classes, HF's logits and greedy tokens, a one-step driver of our
model over the engine's caches, and the engine-level checks every hybrid shares.
"""

from __future__ import annotations

import inspect
import json
import os
import random
from pathlib import Path

import pytest
import torch

from tests.models.mamba2_utils import BF16_ERROR_VS_HF_BF16, assert_close, gen_for
from tests.tiny_model import save_tiny_tokenizer
from vllm import LLM, SamplingParams
from vllm.distributed import get_tp_group
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.utils import bind_kv_cache, bind_state_pool
from vllm.worker.cache_engine import CacheEngine

VOCAB = 320  # the tiny tokenizer's size: every id the model can sample decodes
# The builders' overrides for the engine and server tests' checkpoints (the mixed graphs',
# the served hybrids', the penalties'): every layer kind once in the fewest layers, as each
# layer is a second of interpreted work per step on the CPU. Zamba2's one shared block is
# used twice (two KV caches on one block's weights); NemotronH-MoE: Mamba2, MoE, attention,
# MLP; Jamba: Mamba1 with a dense MLP, then attention with experts.
FEW_LAYERS = {
    "bamba": dict(num_hidden_layers=2, attn_layer_indices=[1]),
    "zamba2": dict(
        num_hidden_layers=3, num_mem_blocks=1, layers_block_type=["mamba", "hybrid", "hybrid"]
    ),  # fmt: skip
    "granite": dict(num_hidden_layers=2, layer_types=["mamba", "attention"]),
    "nemotron_h_moe": dict(pattern="ME*-"),
    "lfm2": dict(num_hidden_layers=2, layer_types=["conv", "full_attention"]),
    "jamba": dict(num_hidden_layers=2),
}


@torch.no_grad()
def perturb(model, seed: int):
    """Every parameter random and non-trivial (HF initialises norms to 1, D to 1, biases
    to 0: a test on those could not see a swapped or dropped term). dt_bias stays so that
    dt = softplus(dt + dt_bias) sits far above any floor (time_step_min)."""
    gen = gen_for("hybrid-weights", seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.0, 2.5, generator=gen))
        elif name.endswith("dt_bias"):
            p.copy_(0.3 * noise - 0.5)
        elif name.endswith("norm.weight") or "layernorm" in name or name.endswith("norm_f.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith(".D") or name.endswith("conv1d.bias") or name.endswith("conv1d.weight"):
            p.copy_(0.5 * noise)
        else:
            p.copy_(0.2 * noise)
    return model.eval()


def save_checkpoint(hf, path: Path) -> Path:
    """``save_pretrained`` of an HF model plus the tiny tokenizer, as a model directory."""
    path.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(path)
    save_tiny_tokenizer(path, VOCAB)
    return path


def tokens(n: int, *key) -> list[int]:
    return torch.randint(5, VOCAB, (n,), generator=gen_for(*key)).tolist()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) fp32 logits of one sequence, HF's full forward."""
    return hf(torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int, eos_token_id=None, **generate_kwargs) -> list[int]:
    """HF ``generate``'s n greedy tokens with EOS an ordinary token, as ``ignore_eos``
    makes it for us: no EOS stops it and none is forbidden (``min_new_tokens`` would keep n
    by forbidding EOS, and differ from us wherever EOS is the argmax). ``eos_token_id``:
    an EOS that ends it (then fewer than n may come back); ``generate_kwargs``: HF's logits
    processors (``repetition_penalty``, ``min_new_tokens``)."""
    eos = hf.generation_config.eos_token_id
    hf.generation_config.eos_token_id = eos_token_id
    try:
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            **generate_kwargs,
        )
    finally:
        hf.generation_config.eos_token_id = eos
    got = out[0, len(prompt) :].tolist()
    assert len(got) == n or eos_token_id is not None, got
    return got


class HybridDriver:
    """Our model over the engine's caches (``CacheEngine``), one mixed step at a time.

    ``step(rows)``: rows of (sequence id, new tokens) in canonical order (one-token
    continuations first); each sequence keeps its state slot, its cached length and its
    KV blocks across steps. Blocks are handed out in a shuffled order, so block tables are
    never contiguous. Returns each row's logits (len(tokens), vocab), or None per row on
    ranks other than 0 of a tensor-parallel group.
    """

    def __init__(self, model, num_slots: int = 6, block_size: int = 4, num_blocks: int = 96):
        from vllm.model_executor.layers.attention import AttentionMetadataBuilder

        self.model = model
        self.device = model.head_weight().device
        self.block_size = block_size
        self.cache = CacheEngine(
            model,
            num_slots=num_slots,
            block_size=block_size,
            ssm_dtype=torch.float32,
            device=self.device,
        )
        self.cache.allocate_kv(num_blocks)
        self.builder = model.metadata_builder(self.device)
        self.attn = AttentionMetadataBuilder(block_size, num_slots, 512, 64, self.device)
        self.free = list(range(num_blocks))
        random.Random(num_blocks).shuffle(self.free)
        self.free_slots = list(range(1, num_slots + 1))  # line 0 is the null line
        self.seqs: dict[str, dict] = {}

    @torch.no_grad()
    def step(self, rows: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        lens, slots, contexts, tables, positions = [], [], [], [], []
        for sid, toks in rows:
            if sid not in self.seqs:
                self.seqs[sid] = {"slot": self.free_slots.pop(0), "len": 0, "blocks": []}
            seq = self.seqs[sid]
            need = -(-(seq["len"] + len(toks)) // self.block_size)
            while len(seq["blocks"]) < need:
                seq["blocks"].append(self.free.pop())
            lens.append(len(toks))
            slots.append(seq["slot"])
            contexts.append(seq["len"])
            tables.append(list(seq["blocks"]))
            positions += range(seq["len"], seq["len"] + len(toks))
        qsl = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        md = self.builder.build(
            qsl, torch.tensor(slots, dtype=torch.int32), torch.tensor([c > 0 for c in contexts])
        )
        assert md.token_perm is None, "rows must come in canonical order"
        attn_md = self.attn.build(lens, contexts, tables, md.num_decode_tokens)
        ids = torch.tensor([t for _, toks in rows for t in toks], device=self.device)
        # Drivers may share a model: this one's caches go back to the layers first.
        bind_state_pool(self.model, self.cache.mamba_pool)
        bind_kv_cache(self.model, self.cache.kv_caches)
        with set_forward_context(ForwardContext(mamba2_metadata=md, attn_metadata=attn_md)):
            hidden = self.model(ids, torch.tensor(positions, device=self.device))
        logits = self.model.compute_logits(hidden)
        out, start = [], 0
        for (sid, _), n in zip(rows, lens, strict=True):
            self.seqs[sid]["len"] += n
            # None off rank 0 of a tensor-parallel group (the logits are gathered there)
            out.append(None if logits is None else logits[start : start + n].cpu())
            start += n
        return out


def mixed_steps() -> list[list[tuple[str, list[int]]]]:
    """Three mixed steps of ``HybridDriver.step`` rows (fresh prompts, a chunked prefill
    continued, decodes beside them, sequences ending mid-block)."""
    a, b, c = tokens(13, "A"), tokens(6, "B"), tokens(4, "C")
    return [
        [("a", a[:5]), ("b", b)],  # two fresh prompts, a's first chunk
        [("b", tokens(1, "B+")), ("a", a[5:11]), ("c", c)],  # a decode, a continuation, a fresh one
        [("b", tokens(1, "B++")), ("c", tokens(1, "C+")), ("a", a[11:])],  # two decodes, a's end
    ]


def check_varlen_batch_and_chunks(model) -> None:
    """Three prompts in one step (then a decode each) give each one's logits alone; a
    prompt fed in chunks of 3, 1 and 5 tokens gives its one-prefill logits."""
    prompts = {s: tokens(n, "varlen", s) for s, n in (("a", 7), ("b", 2), ("c", 9))}
    nexts = {s: tokens(1, "next", s) for s in prompts}
    batched = HybridDriver(model)
    first = batched.step(list(prompts.items()))
    second = batched.step(list(nexts.items()))
    for i, sid in enumerate(prompts):
        alone = HybridDriver(model)
        assert_close(first[i], alone.step([(sid, prompts[sid])])[0], "batching", msg=sid)
        assert_close(second[i], alone.step([(sid, nexts[sid])])[0], "batching", msg=sid)
    whole = prompts["c"]
    one = HybridDriver(model).step([("c", whole)])[0]
    chunked = HybridDriver(model)
    parts = [chunked.step([("c", part)])[0] for part in (whole[:3], whole[3:4], whole[4:])]
    assert_close(torch.cat(parts), one, "batching")


def check_bad_config_refused(path: Path, tmp_path: Path, edit: dict, match: str) -> None:
    """The checkpoint's config.json with ``edit`` applied is refused at load, the
    ValueError matching ``match``."""
    raw = json.loads((path / "config.json").read_text())
    raw.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match):
        get_model(tmp_path, load_format="dummy")


def check_mixed_steps_match_hf(model, hf) -> None:
    """``mixed_steps`` against HF's full-sequence logits, row by row."""
    driver = HybridDriver(model)
    got, full = {}, {}
    for rows in mixed_steps():
        for (sid, toks), logits in zip(rows, driver.step(rows), strict=True):
            got.setdefault(sid, []).append(logits)
            full[sid] = full.get(sid, []) + toks
    for sid, seq in full.items():
        assert_close(torch.cat(got[sid]), hf_logits(hf, seq), "vs_hf", msg=f"sequence {sid}")


def run_steps(model) -> list[list[torch.Tensor | None]]:
    driver = HybridDriver(model)
    return [driver.step(rows) for rows in mixed_steps()]


def check_steps_match(model, expected, atol: float) -> None:
    """``run_steps`` on this rank's shard of the model: rank 0's logits equal one rank's
    ``expected`` within ``atol`` (rtol 1e-5); the other ranks get none."""
    rank = get_tp_group().rank
    for step, (rows, want) in enumerate(zip(run_steps(model), expected, strict=True)):
        for g, e in zip(rows, want, strict=True):
            if rank != 0:
                assert g is None  # logits are gathered on rank 0 only
            else:
                torch.testing.assert_close(
                    g, e, atol=atol, rtol=1e-5, msg=lambda m, s=step: f"step {s}: {m}"
                )


def engine(path, device="cpu", **kwargs) -> LLM:
    """An fp32 engine with small limits: chunked prefill beside decodes, small blocks."""
    options = dict(
        dtype="float32",
        device=str(device),
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=96,
        block_size=4,
        enforce_eager=True,
    )
    if torch.device(device).type == "cuda":
        # A fixed KV cache (8 sequences of max_model_len): sized from free GPU memory, it
        # would count what the suite's other workers hold on the same GPU at that moment.
        options["num_gpu_blocks_override"] = 8 * 96 // 4
    return LLM(str(path), **{**options, **kwargs})


def check_generate_matches_hf(path, hf, device="cpu", max_tokens: int = 6) -> LLM:
    """LLM.generate's greedy tokens on prompts of several lengths sent together (chunked
    prefill beside decodes under a 16-token budget) equal HF generate's, prompt by prompt;
    every KV block is free again at the end."""
    llm = engine(path, device)
    prompts = [tokens(n, "gen", n) for n in (3, 21, 9, 1, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        expected = hf_greedy(hf, prompt, max_tokens)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"
    check_no_kv_leak(llm)
    return llm


def check_no_kv_leak(llm: LLM) -> None:
    sched = llm.engine.scheduler
    assert sched.kv is not None, "a hybrid model must get a KV cache"
    assert not sched.running and not sched.waiting
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and sched.kv.num_reserved == 0


def hf_norms_per_group(norm_cls) -> bool:
    """Whether a transformers gated-norm class normalises per group (``group_size``);
    older releases (Bamba's in 5.17) normalise the whole inner width, so with n_groups > 1
    they are no oracle."""
    return "group_size" in inspect.signature(norm_cls.__init__).parameters


@torch.no_grad()
def hf_params_as_ours(model, hf) -> dict[str, torch.Tensor]:
    """HF's parameters as our one-rank ``model`` holds them: named through the model's
    name map, the parts of a fused layer (q/k/v, gate/up) stacked in the order its
    ``stacked_params_mapping`` lists them, conv weights without HF's middle dim of 1, the
    vocabulary padded with zero rows to our table's."""
    ours = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, p in hf.named_parameters():
        mapped = model.hf_to_param_name(name)
        if mapped is None:
            continue
        p = p.detach().squeeze(1) if mapped.endswith("conv1d.weight") else p.detach()
        head, _, leaf = mapped.rpartition(".")
        owner, _, module = head.rpartition(".")
        for i, (fused, part, _) in enumerate(model.stacked_params_mapping):
            if part == module:
                parts.setdefault(f"{owner}.{fused}.{leaf}", {})[i] = p
                break
        else:
            out[mapped] = p
    out.update({n: torch.cat([d[i] for i in sorted(d)]) for n, d in parts.items()})
    for name, t in out.items():
        rows = ours[name].shape[0] if name in ours else t.shape[0]
        if rows > t.shape[0] and t.shape[1:] == ours[name].shape[1:]:  # padded vocabulary
            out[name] = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
    return out


def assert_loaded_as_hf(model, hf) -> None:
    """Every parameter of ``model`` holds exactly HF's weights (``hf_params_as_ours``)."""
    ours = dict(model.named_parameters())
    theirs = hf_params_as_ours(model, hf)
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for name, expected in theirs.items():
        assert torch.equal(ours[name], expected), name


def check_loads_every_hf_weight(path, hf, model_cls):
    """``get_model`` of the checkpoint is a ``model_cls`` whose parameters are exactly HF's
    (``assert_loaded_as_hf``: q/k/v and gate/up fused, conv weights without HF's middle
    dim of 1). Returns the model."""
    from vllm.model_executor.model_loader import get_model

    model = get_model(path)
    assert isinstance(model, model_cls)
    assert_loaded_as_hf(model, hf)
    return model


def record_figure(line: str) -> None:
    """Print ``line`` and, when ``VLLM_TEST_RECORD`` names a file (scripts/gpu_check.sh sets
    it), append it there: pytest -q hides the prints, the GPU run's summary quotes the file."""
    print(line)
    target = os.environ.get("VLLM_TEST_RECORD")
    if target:
        with open(target, "a") as f:
            f.write(line + "\n")


def check_bf16_tracks_hf(hf32, hf16, path, device) -> None:
    """bf16 weights and activations on ``device``: our logits of a prefill and three
    decode steps vs HF's fp32 logits of the same weights, within the bf16 bounds and at
    most BF16_ERROR_VS_HF_BF16 x HF's own bf16 error."""
    from vllm.model_executor.model_loader import get_model

    model = get_model(path, dtype="bfloat16", device=device)
    prompt, nexts = tokens(19, "bf16-prompt"), tokens(3, "bf16-next")
    driver = HybridDriver(model)
    got = [driver.step([("s", prompt)])[0]]
    for t in nexts:
        got.append(driver.step([("s", [t])])[0])
    got = torch.cat(got)
    full = prompt + nexts
    expected = hf_logits(hf32, full)[: len(full)]
    hf_err = (hf_logits(hf16, full).float() - expected).abs().max().item()
    ours_err = (got - expected).abs().max().item()
    record_figure(
        f"{type(model).__name__} bf16 on {device}: max |ours - hf_fp32| = {ours_err:.4f}, "
        f"max |hf_bf16 - hf_fp32| = {hf_err:.4f} (ratio {ours_err / max(hf_err, 1e-12):.2f})"
    )
    # HF's own bf16 run is the yardstick (random weights at this shape can have logits
    # whose bf16 rounding alone exceeds the fixed table); both errors are in the message.
    assert ours_err <= BF16_ERROR_VS_HF_BF16 * hf_err, (
        f"max |ours_bf16 - hf_fp32| = {ours_err:.4f} > {BF16_ERROR_VS_HF_BF16} x "
        f"max |hf_bf16 - hf_fp32| = {hf_err:.4f}"
    )


def check_graphs_match_eager(path, device) -> None:
    """Decode steps through the CUDA graphs (attention layers inside) give the tokens the
    eager path gives, and the graphs did run."""
    prompts = [tokens(n, "graph", n) for n in (5, 17, 2, 9, 30, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = engine(path, device=device, enforce_eager=eager, max_num_seqs=8)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if not eager:
            assert llm.engine.runner.graphs._graphs, "no decode step ran through a graph"
        check_no_kv_leak(llm)
    assert outs[True] == outs[False]
