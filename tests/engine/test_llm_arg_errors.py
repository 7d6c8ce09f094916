"""``LLM(...)`` arguments that cannot work: each error names the argument (or the file) and
the fix, before any model is built."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_model import make_tiny_model_dir
from vllm import LLM


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), num_hidden_layers=1)


@pytest.mark.parametrize("model", [None, "", 3])
def test_model_that_is_not_a_model(model):
    with pytest.raises(ValueError) as err:
        LLM(model)
    assert str(err.value) == (
        "model must be a model directory, a Hugging Face Hub id (ORG/NAME) or a registered "
        f"model config such as Mamba2ModelConfig, got {model!r}"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_on_a_machine_without_it(model_dir, device):
    with pytest.raises(ValueError) as err:
        LLM(str(model_dir), device=device)
    message = str(err.value)
    assert message.startswith(f"device={device!r}, but no CUDA device is available ("), message
    assert message.endswith(
        "use device='cpu' (--device cpu), or 'auto' to take a GPU when there is one"
    ), message


@pytest.mark.parametrize("device", ["bogus", "tpu", "cuda:x", 0])
def test_unknown_device(model_dir, device):
    with pytest.raises(ValueError) as err:
        LLM(str(model_dir), device=device)
    assert str(err.value) == (
        f"device={device!r} is not supported: give 'auto' (CUDA when there is a GPU, else "
        "CPU), 'cuda', 'cuda:N' or 'cpu'"
    )


def test_truncated_weights_name_the_file(model_dir, tmp_path):
    broken = make_tiny_model_dir(tmp_path / "broken", num_hidden_layers=1)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError) as err:
        LLM(str(broken), device="cpu")
    message = str(err.value)
    assert message.startswith(f"{weights} is not a readable safetensors file ("), message
    assert message.endswith("it is truncated or corrupt; download or save it again"), message


def test_unknown_load_format(model_dir):
    with pytest.raises(ValueError, match="load_format must be one of auto, safetensors, dummy"):
        LLM(str(model_dir), load_format="pt")
