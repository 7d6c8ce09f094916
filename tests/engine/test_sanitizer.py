"""A clean start-up under compute-sanitizer's initcheck.

Start-up's compile-only pass (``precompile``) runs the model with every Triton launch
recorded instead of run, so the PyTorch ops between launches read outputs no kernel wrote.
Inside the block PyTorch fills each new tensor, so nothing reads memory that was never
written; the GPU test runs start-up and a few served steps of a tiny Mamba2 and a tiny
Bamba under initcheck and expects no report at all.

The models run in float32. On the H200 (CUDA 13.0's compute-sanitizer, torch 2.11) initcheck
does not see cuBLAS's 16-bit matmuls write their outputs: ``F.linear`` of two random bf16 or
fp16 tensors followed by ``.float()``, with no engine code at all, reports every output
element as an uninitialized read (1280 of 1280 for a 5 x 256 output; fp32: 0). In bf16
every linear layer's output would be reported, hiding any real report.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from vllm.triton_utils.launch import precompile


def test_precompile_fills_new_tensors_and_restores_the_mode():
    was_on = torch.are_deterministic_algorithms_enabled()
    with precompile():
        floats = torch.empty(64)
        ints = torch.empty(8, dtype=torch.int32)
    assert torch.isnan(floats).all()
    assert (ints == torch.iinfo(torch.int32).max).all()
    assert torch.are_deterministic_algorithms_enabled() == was_on


def test_precompile_restores_the_mode_after_an_error():
    import torch.utils.deterministic as det

    fill = det.fill_uninitialized_memory
    with pytest.raises(ZeroDivisionError), precompile():
        1 / 0  # noqa: B018
    assert not torch.are_deterministic_algorithms_enabled()
    assert det.fill_uninitialized_memory == fill


def test_precompile_does_not_import_inductor():
    """torch.use_deterministic_algorithms imports torch._inductor (seconds of start-up);
    precompile sets the same switch without it."""
    code = (
        "import sys, torch\n"
        "from vllm.triton_utils.launch import precompile\n"
        "assert 'torch._inductor' not in sys.modules, 'imported before the block'\n"
        "with precompile():\n"
        "    assert torch.are_deterministic_algorithms_enabled()\n"
        "    assert torch.isnan(torch.empty(4)).all()\n"
        "print('torch._inductor' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


_CHILD = textwrap.dedent(
    """
    import sys
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models.bamba_config import BambaModelConfig
    from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
    if sys.argv[1] == "mamba2":
        cfg = Mamba2ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                num_heads=4, head_dim=32, state_size=16, n_groups=1,
                                chunk_size=16)
    else:
        cfg = BambaModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=2, attn_layer_indices=(1,),
                               num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4,
                               mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16,
                               max_position_embeddings=256)
    llm = LLM(cfg, load_format="dummy", dtype="float32", device="cuda", max_num_seqs=4,
              max_num_batched_tokens=64, max_model_len=256, num_gpu_blocks_override=128)
    prompts = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate([5, 40, 1, 90])]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    print("served", sum(len(o.outputs[0].token_ids) for o in outs))
    """
)


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        path = os.path.join(root or "", "bin", "compute-sanitizer")
        if root and os.path.exists(path):
            return path
    return None


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", ["mamba2", "bamba"])
def test_startup_and_steps_clean_under_initcheck(model, tmp_path):
    tool = _sanitizer()
    if tool is None:
        pytest.skip("compute-sanitizer is not installed (it ships with the CUDA toolkit)")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton_cache"))
    env.pop("TRITON_INTERPRET", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [tool, "--tool", "initcheck", "--print-limit", "20", "--error-exitcode", "3",
           sys.executable, "-c", _CHILD, model]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert "served 24" in out, out[-4000:]
    assert proc.returncode == 0 and "ERROR SUMMARY: 0 errors" in out, out[-6000:]
