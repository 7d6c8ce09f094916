"""`vllm serve` on each hybrid architecture (Bamba, NemotronH, Zamba2, LFM2), on the
Mamba1 family (FalconMamba; Jamba: Mamba1 + attention + MoE experts) and on the MoE
hybrids (Granite-4.0-H, NemotronH with MoE layers, Falcon-H1): the console
script in a real process per tiny checkpoint (saved by transformers' own classes), real
HTTP. On the CPU here and, marked ``gpu``, on the GPU box (the tiny checkpoints in fp32 on
CUDA: the Triton kernels, CUDA graphs for decode steps).

Greedy completions from the server (prompts as token ids, several sent at once so
prefill chunks run beside decodes, then a streamed one) equal the same prompts through
``LLM.generate`` on the same directory, whose tokens tests/models prove equal to HF
generate's. A second round of the same requests, on the KV blocks the first one freed,
gives the same text; a prompt over the limit is a 400 and the server carries on.
"""

from __future__ import annotations

import concurrent.futures
from functools import partial

import httpx
import pytest

from tests.entrypoints.utils import RemoteServer
from tests.models.falcon_h1_utils import make_falcon_h1_hf
from tests.models.granitemoehybrid_utils import make_granite_hf
from tests.models.hf_builders import make_bamba_hf, make_nemotron_h_hf, make_zamba2_hf
from tests.models.hybrid_utils import FEW_LAYERS, save_checkpoint, tokens
from tests.models.jamba_utils import make_jamba_hf
from tests.models.lfm2_utils import make_lfm2_hf
from tests.models.mamba1_utils import make_hf as make_mamba1_hf
from tests.models.nemotron_h_moe_utils import make_nemotron_h_moe_hf
from vllm import LLM, SamplingParams

# Every layer kind once in the fewest layers (FEW_LAYERS): what is compared is the server
# against the offline engine on the same directory.
MAKERS = {
    "bamba": partial(make_bamba_hf, **FEW_LAYERS["bamba"]),
    "nemotron_h": make_nemotron_h_hf,  # on the GPU box only (GPU_ONLY)
    "zamba2": partial(make_zamba2_hf, **FEW_LAYERS["zamba2"]),
    "lfm2": partial(make_lfm2_hf, **FEW_LAYERS["lfm2"]),
    "falcon_mamba": lambda: make_mamba1_hf("falcon_mamba"),
    "jamba": partial(make_jamba_hf, **FEW_LAYERS["jamba"]),
    # The MoE hybrids of issue 34 (Jamba above is the fourth).
    "granitemoehybrid": partial(make_granite_hf, **FEW_LAYERS["granite"]),
    "nemotron_h_moe": partial(make_nemotron_h_moe_hf, **FEW_LAYERS["nemotron_h_moe"]),
    "falcon_h1": make_falcon_h1_hf,
}
# Small limits, as the model tests use: a 16-token step budget and 4-token blocks.
# A fixed KV cache (not a share of GPU memory, which other test processes on the box hold).
ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=96,
    block_size=4,
    num_gpu_blocks_override=128,
)
PROMPTS = [tokens(n, "serve", n) for n in (3, 21, 9, 14)]
MAX_TOKENS = 4  # decodes beside the longer prompts' prefill chunks


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _cli_args(device: str) -> list[str]:
    args = ["--served-model-name", "hybrid", "--dtype", "float32", "--seed", "0"]
    args += ["--device", device]
    for key, value in ENGINE.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    return args


# nemotron_h is the same NemotronHForCausalLM (config, loader, layers) as nemotron_h_moe,
# whose pattern holds each of its layer kinds (Mamba2, attention, MLP): on the CPU it would
# serve the same code a second time, so it runs on the GPU box only.
GPU_ONLY = {"nemotron_h"}


@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=pytest.mark.gpu) if n in GPU_ONLY else n for n in MAKERS],
)
def model_dir(request, tmp_path_factory):
    hf = MAKERS[request.param]()
    return save_checkpoint(hf, tmp_path_factory.mktemp(request.param))


def _offline_texts(path, device: str) -> list[str]:
    # Eager on the CPU (no graphs there); on CUDA as the server runs, with decode graphs.
    eager = device == "cpu"
    llm = LLM(str(path), dtype="float32", device=device, enforce_eager=eager, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.outputs[0].text for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def _complete(base: str, prompt: list[int]) -> dict:
    body = {
        "model": "hybrid",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_served_matches_offline(model_dir, device):
    expected = _offline_texts(model_dir, device)
    with RemoteServer(model_dir, _cli_args(device), console_script=True) as server:
        base = server.url_for("").rstrip("/")
        for _ in range(2):  # the second round runs on blocks the first one freed
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                results = list(pool.map(lambda p: _complete(base, p), PROMPTS))
            for prompt, result, text in zip(PROMPTS, results, expected, strict=True):
                choice = result["choices"][0]
                assert choice["text"] == text, f"prompt of {len(prompt)} tokens"
                assert result["usage"]["completion_tokens"] == MAX_TOKENS
                assert result["usage"]["prompt_tokens"] == len(prompt)
        client = server.openai_client()
        stream = client.completions.create(
            model="hybrid",
            prompt=PROMPTS[1],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert streamed == expected[1]
        # A prompt past max_model_len is a 400 naming the limit; the server goes on.
        resp = httpx.post(
            f"{base}/v1/completions",
            json={"model": "hybrid", "prompt": [5] * 200, "max_tokens": 1},
            timeout=60,
        )
        assert resp.status_code == 400 and "maximum context length is 96" in resp.text, resp.text
        assert _complete(base, PROMPTS[0])["choices"][0]["text"] == expected[0]
