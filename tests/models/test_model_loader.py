"""The model loader: HF directories, dummy weights, and the errors a user can meet."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.hf_builders import make_bamba_hf
from tests.models.hybrid_utils import assert_loaded_as_hf, save_checkpoint
from tests.models.mamba2_utils import TINY, Driver, Row, hf_config, make_hf_model
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.model_loader.weight_utils import _dummy_value, dummy_weights
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    hf = make_hf_model(hf_config(), seed=7)
    path = tmp_path_factory.mktemp("loader_model")
    hf.save_pretrained(path)
    return hf, path


def copy_dir(src, dst, config_edit=None, weights_edit=None):
    """A copy of a saved model with config.json and/or the weights changed."""
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    weights = load_file(str(src / "model.safetensors"))
    if weights_edit:
        weights_edit(weights)
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def test_loads_every_hf_weight(hf_dir):
    hf, path = hf_dir
    model = get_model(path)
    assert_loaded_as_hf(model, hf)  # the vocabulary padded from 96 rows to 128
    assert model.backbone.embeddings.weight.shape == (128, TINY["hidden_size"])
    assert model.config.time_step_limit == (0.0, math.inf)  # written as {"__float__": ...}
    assert model.dtype == torch.float32 and not model.training


def test_dtype_from_config_and_override(hf_dir):
    _, path = hf_dir
    model = get_model(path, dtype="bfloat16")
    assert model.backbone.embeddings.weight.dtype == torch.bfloat16
    # A, D and dt_bias stay fp32
    assert model.backbone.layers[0].mixer.A_log.dtype == torch.float32


def test_dummy_weights_for_any_config_without_disk():
    cfg = Mamba2ModelConfig(**{**TINY, "n_groups": 2})
    a = get_model(cfg, load_format="dummy", seed=5)
    b = get_model(cfg, load_format="dummy", seed=5)
    c = get_model(cfg, load_format="dummy", seed=6)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert torch.isfinite(pa).all(), name
        if pa.numel() > 1:
            assert not torch.equal(pa, pc), name
    mixer = a.backbone.layers[0].mixer
    assert (mixer.A_log.exp() >= 1).all() and (mixer.A_log.exp() <= 16).all()
    logits = Driver(a).step([Row(1, [1, 2, 3, 4, 5])])[0]
    assert torch.isfinite(logits).all() and logits.std() > 0


@pytest.mark.parametrize(
    "name, shape",
    [("layers.0.mixer.in_proj.weight", (96, 32)), ("layers.0.moe.experts.w2", (4, 32, 96))],
)
def test_dummy_matrices_keep_unit_variance(name, shape):
    """A dummy matrix scales by its input dimension (the last), so a unit-variance input
    gives unit-variance outputs for a (out, in) matrix and each expert of a stack."""
    w = _dummy_value(name, shape, torch.device("cpu"), seed=0)
    x = torch.randn(4096, shape[-1], generator=torch.Generator().manual_seed(0))
    y = x @ w.reshape(-1, shape[-1]).t()
    assert 0.8 < y.var().item() < 1.25, y.var().item()


@pytest.mark.parametrize("name", ["layers.0.mixer.dt_bias", "layers.0.mixer.dt_proj.bias"])
def test_dummy_dt_bias_is_an_inverse_softplus(name):
    """Mamba2's dt_bias and Mamba1's dt_proj.bias both give dt = softplus(bias) in HF's
    initial range [1e-3, 0.1] (a generic bias would give dt near 0.7)."""
    dt = torch.nn.functional.softplus(_dummy_value(name, (64,), torch.device("cpu"), seed=0))
    assert (dt >= 1e-3 * 0.999).all() and (dt <= 0.1 * 1.001).all()


def test_dummy_from_a_directory_with_config_only(tmp_path, hf_dir):
    _, path = hf_dir
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    model = get_model(tmp_path, load_format="dummy")
    assert model.config.hidden_size == TINY["hidden_size"]
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        get_model(tmp_path)


def test_default_config_is_the_codestral_7b_shape():
    cfg = Mamba2ModelConfig()
    shape = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_heads, cfg.head_dim)
    assert shape == (4096, 64, 128, 64)
    assert (cfg.state_size, cfg.n_groups, cfg.conv_kernel) == (128, 8, 4)


def test_legacy_embedding_name_and_tied_head(tmp_path, hf_dir):
    _, path = hf_dir

    def rename_and_drop_head(w):
        w["backbone.embedding.weight"] = w.pop("backbone.embeddings.weight")
        del w["lm_head.weight"]

    src = copy_dir(
        path,
        tmp_path / "legacy",
        lambda c: c.update(tie_word_embeddings=True),
        rename_and_drop_head,
    )
    model = get_model(src)
    assert model.lm_head.weight is model.backbone.embeddings.weight
    hidden = torch.randn(2, TINY["hidden_size"])
    expected = hidden @ model.backbone.embeddings.weight[: TINY["vocab_size"]].t()
    torch.testing.assert_close(model.compute_logits(hidden), expected)


# ---- errors -------------------------------------------------------------------------


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        get_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        get_model(tmp_path)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"]), "unsupported"),
        (lambda c: c.update(num_heads=3), "must equal num_heads \\* head_dim"),
        (lambda c: c.update(n_groups=3), "multiple of n_groups"),
        (lambda c: c.update(conv_kernel=9), "conv_kernel=9 is not supported"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
        (lambda c: c.pop("hidden_size"), "missing required fields: hidden_size"),
        (lambda c: c.update(use_bias="yes"), "use_bias must be true or false"),
        (lambda c: c.update(time_step_limit=[0.0]), "time_step_limit"),
    ],
    ids=["model_type", "heads", "groups", "conv_kernel", "act", "missing", "bool", "limit"],
)
def test_bad_configs(tmp_path, hf_dir, edit, match):
    _, path = hf_dir
    with pytest.raises(ValueError, match=match):
        get_model(copy_dir(path, tmp_path / "m", config_edit=edit))


def test_weight_shape_mismatch(tmp_path, hf_dir):
    _, path = hf_dir
    # consistent config, but not the one the weights were trained with
    src = copy_dir(path, tmp_path / "m", config_edit=lambda c: c.update(state_size=4))
    with pytest.raises(ValueError, match="has shape .* in the checkpoint, but the config makes"):
        get_model(src)


def test_missing_and_unknown_weights(tmp_path, hf_dir):
    _, path = hf_dir
    src = copy_dir(path, tmp_path / "a", weights_edit=lambda w: w.pop("backbone.layers.1.mixer.D"))
    with pytest.raises(ValueError, match="lacks weights .*layers.1.mixer.D"):
        get_model(src)
    src = copy_dir(
        path, tmp_path / "b", weights_edit=lambda w: w.update({"backbone.extra": torch.zeros(2)})
    )
    with pytest.raises(ValueError, match="does not know: \\['backbone.extra'\\]"):
        get_model(src)


def test_bad_arguments(hf_dir):
    _, path = hf_dir
    with pytest.raises(ValueError, match="load_format 'pt'"):
        get_model(path, load_format="pt")
    with pytest.raises(ValueError, match="dtype 'int8'"):
        get_model(path, dtype="int8")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        get_model(Mamba2ModelConfig(**TINY))


def _shard(path, dst):
    """``path``'s checkpoint as two shards and the index that names them, plus a second copy
    of every weight under other names (as Mistral's consolidated.safetensors sits beside the
    HF shards of Mamba-Codestral): read, it would be weights the model does not know."""
    dst.mkdir()
    (dst / "config.json").write_text((path / "config.json").read_text())
    weights = load_file(str(path / "model.safetensors"))
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(dst / shard))
        weight_map.update({k: shard for k in keys})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(
        {f"mistral.{k}": v for k, v in weights.items()}, str(dst / "consolidated.safetensors")
    )
    return dst


def test_sharded_checkpoint_reads_the_shards_its_index_names(tmp_path, hf_dir):
    hf, path = hf_dir
    assert_loaded_as_hf(get_model(_shard(path, tmp_path / "sharded")), hf)


def test_a_shard_the_index_names_is_missing(tmp_path, hf_dir):
    _, path = hf_dir
    src = _shard(path, tmp_path / "sharded")
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="index.json lists shards .*model-00002-of-00002"):
        get_model(src)


@pytest.mark.parametrize("keep", [0.5, 0.0], ids=["tensors_cut", "empty"])
def test_truncated_safetensors_names_the_file(tmp_path, hf_dir, keep):
    _, path = hf_dir
    src = copy_dir(path, tmp_path / "m")
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError) as err:
        get_model(src)
    message = str(err.value)
    assert message.startswith(f"{weights} is not a readable safetensors file"), message
    assert "truncated or corrupt; download or save it again" in message


def test_the_dummy_checkpoint_is_a_real_checkpoints_layout(tmp_path):
    """Dummy weights are a random checkpoint of the model's own layout, loaded through
    ``load_weights``: the tensors a real checkpoint holds (q/k/v and gate/up apart, each
    drawn under its own name at full shape), so saved and loaded back they give the same
    model."""
    path = save_checkpoint(make_bamba_hf(attention_bias=True), tmp_path / "bamba")
    real = {k: tuple(v.shape) for k, v in load_file(str(path / "model.safetensors")).items()}
    model = get_model(path, load_format="dummy", seed=3)
    drawn = dict(dummy_weights(model, seed=3))
    assert {k: tuple(v.shape) for k, v in drawn.items()} == {
        k: (s[0], s[2]) if k.endswith("conv1d.weight") else s for k, s in real.items()
    }
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "config.json").write_text((path / "config.json").read_text())
    save_file(
        {k: v.unsqueeze(1) if k.endswith("conv1d.weight") else v for k, v in drawn.items()},
        str(tmp_path / "again" / "model.safetensors"),
    )
    again = dict(get_model(tmp_path / "again").named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(again[name], param), name
