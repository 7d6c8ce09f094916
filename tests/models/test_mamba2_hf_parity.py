"""Our Mamba2ForCausalLM vs HF transformers' on tiny random models saved with save_pretrained.

fp32 on CPU (the conv kernels run under the Triton interpreter): prefill logits of a
multi-sequence step, then decode steps carried by our state pool vs HF's cached decode.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.mamba2_utils import (
    BF16,
    BF16_ERROR_VS_HF_BF16,
    Driver,
    Row,
    assert_close,
    gen_for,
    hf_config,
    hf_norms_per_group,
    hf_oracle_groups,
    hf_prefill_then_decode,
    make_hf_model,
)
from vllm.model_executor.model_loader import get_model

# n_groups=1 is the oracle case; where the installed transformers normalises per
# group (newer releases), n_groups=2 is compared with HF as well (and always with our own
# reference in test_mamba2_batching).
CONFIGS = {
    "G1": dict(n_groups=1),
    "G2": dict(n_groups=2),
    "G1_tied": dict(n_groups=1, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def hf_and_dir(request, tmp_path_factory):
    if CONFIGS[request.param]["n_groups"] > 1 and not hf_norms_per_group():
        pytest.skip("this transformers normalises the gated RMSNorm over all groups: no oracle")
    hf = make_hf_model(hf_config(**CONFIGS[request.param]), seed=len(request.param))
    path = tmp_path_factory.mktemp(f"mamba2_{request.param}")
    hf.save_pretrained(path)
    return hf, path


def tokens(n: int, key) -> list[int]:
    return torch.randint(0, 96, (n,), generator=gen_for(key)).tolist()


def test_prefill_logits_match_hf(hf_and_dir, device):
    hf, path = hf_and_dir
    model = get_model(path, dtype="float32", device=device)
    prompts = [tokens(21, "p0"), tokens(6, "p1"), tokens(1, "p2")]
    driver = Driver(model)
    ours = driver.step([Row(slot, p) for slot, p in zip((3, 7, 5), prompts, strict=True)])
    for prompt, logits in zip(prompts, ours, strict=True):
        expected, _ = hf_prefill_then_decode(hf, prompt, [])
        assert_close(logits, expected, "vs_hf", msg=f"prompt of {len(prompt)} tokens")


def test_decode_steps_match_hf_cache(hf_and_dir, device):
    hf, path = hf_and_dir
    model = get_model(path, device=device)
    prompts = {1: tokens(13, "d0"), 4: tokens(5, "d1")}
    nexts = {1: tokens(4, "n0"), 4: tokens(4, "n1")}
    driver = Driver(model)
    first = driver.step([Row(slot, p) for slot, p in prompts.items()])
    got = {slot: [logits[-1:]] for slot, logits in zip(prompts, first, strict=True)}
    for k in range(4):
        out = driver.step([Row(slot, [nexts[slot][k]], True) for slot in prompts])
        for slot, logits in zip(prompts, out, strict=True):
            got[slot].append(logits)
    for slot, prompt in prompts.items():
        expected, cache = hf_prefill_then_decode(hf, prompt, nexts[slot])
        assert_close(torch.cat(got[slot]), expected[len(prompt) - 1 :], "vs_hf", msg=f"slot {slot}")
        # the states our pool carries are HF's (HF's conv cache keeps one extra column)
        for layer in range(model.config.num_hidden_layers):
            conv, ssm = driver.pool.layer(layer)
            assert_close(ssm[slot].cpu(), cache.ssm_state(layer)[0], "vs_hf")
            assert_close(conv[slot].cpu(), cache.conv_state(layer)[0][:, 1:], "vs_hf")


@pytest.mark.parametrize(
    "where", ["cpu_reference_conv", pytest.param("cuda", marks=pytest.mark.gpu)]
)
def test_bf16_logits_track_hf(where, monkeypatch, tmp_path):
    """bf16 weights and activations: our logits vs HF's fp32 logits of the same weights.

    On the CPU the conv runs through the fp32 references (bf16 arithmetic is wrong under
    the Triton interpreter); on the GPU through the Triton kernels.
    """
    if where == "cpu_reference_conv":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = hf_config(n_groups=hf_oracle_groups())
    hf32 = make_hf_model(cfg, seed=11)
    hf32.save_pretrained(tmp_path)
    hf16 = make_hf_model(cfg, seed=11).to(torch.bfloat16)
    model = get_model(tmp_path, dtype="bfloat16", device="cuda" if where == "cuda" else "cpu")
    prompt, nexts = tokens(19, "bf16-prompt"), tokens(3, "bf16-next")
    driver = Driver(model)
    got = [driver.step([Row(1, prompt)])[0]]
    for t in nexts:
        got.append(driver.step([Row(1, [t], True)])[0])
    got = torch.cat(got)
    expected, _ = hf_prefill_then_decode(hf32, prompt, nexts)
    hf_bf16, _ = hf_prefill_then_decode(hf16, prompt, nexts)
    assert_close(got, expected, "vs_hf", BF16)
    ours_err = (got - expected).abs().max().item()
    hf_err = (hf_bf16.float() - expected).abs().max().item()
    assert ours_err <= BF16_ERROR_VS_HF_BF16 * hf_err, (ours_err, hf_err)
