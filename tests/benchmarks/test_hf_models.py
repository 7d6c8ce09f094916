"""benchmarks/common/model_shapes.py and hf_models.py: every named shape builds the
registry's config class of its architecture, the published shapes say what their models
are, and each goes to transformers' config of the same architecture and reads back
unchanged (configs only: no model is built here)."""

from __future__ import annotations

import pytest

from benchmarks.common import hf_models
from benchmarks.common.model_shapes import ARCH_CONFIGS, named_config, shape_names
from vllm.model_executor.models.registry import config_class, supported_architectures


@pytest.mark.parametrize("name", shape_names())
def test_named_shape_is_its_architecture_and_reaches_transformers(name):
    config = named_config(name)
    if name in ARCH_CONFIGS:
        assert config.architecture == ARCH_CONFIGS[name][0]
    assert type(config) is config_class(config.architecture)
    hf = hf_models.hf_config(config)
    assert type(hf) is hf_models.hf_model_class(config).config_class
    assert hf.architectures == [config.architecture]
    assert hf.vocab_size == config.vocab_size and hf.hidden_size == config.hidden_size


@pytest.mark.parametrize("architecture", supported_architectures())
def test_every_registered_default_config_round_trips(architecture):
    config = config_class(architecture)()
    hf_models.check_round_trip(config, hf_models.hf_config(config))


def test_published_shapes():
    falcon = named_config("falcon-mamba-7b")
    assert (falcon.intermediate_size, falcon.state_size, falcon.num_hidden_layers) == (
        8192,
        16,
        64,
    )
    assert falcon.mixer_rms_eps_or_none() == 1e-6
    lfm2 = named_config("lfm2-1.2b")
    assert lfm2.layer_types.count("full_attention") == 6 and lfm2.num_hidden_layers == 16
    assert lfm2.mlp_size() == 8192
    granite = named_config("granite-4.0-h-tiny")
    assert granite.layer_types.count("attention") == 4 and granite.num_local_experts == 64
    nano = named_config("nemotron-3-nano")
    kinds = nano.layer_types
    assert (kinds.count("moe"), kinds.count("mamba"), kinds.count("attention")) == (23, 23, 6)
    hf_nano = hf_models.hf_config(nano)
    assert hf_nano.layers_block_type.count("moe") == 23 and hf_nano.n_routed_experts == 128


def test_a_wrong_mapping_is_refused_by_name(monkeypatch):
    """A field the mapping loses (here state_size: transformers' default 16 where the
    shape has 8) is named by the read-back instead of benchmarking another model."""
    kwargs = hf_models.hf_config_kwargs

    def losing_state_size(config):
        return {k: v for k, v in kwargs(config).items() if k != "state_size"}

    monkeypatch.setattr(hf_models, "hf_config_kwargs", losing_state_size)
    with pytest.raises(ValueError, match="state_size: ours 8, read back 16"):
        hf_models.hf_config(named_config("falcon-mamba-cpu"))


def test_unknown_shape_name():
    with pytest.raises(ValueError, match="unknown model shape 'mamba-9000'.*falcon-mamba-7b"):
        named_config("mamba-9000")
