"""The models whose mixed steps the FULL tests run through the padded path: the CPU check
(test_mixed_graph.py, padded steps run eagerly) and the GPU one (test_mixed_graph_gpu.py,
replayed graphs). Each entry makes the model (a config, or a tiny transformers checkpoint
saved under the test's tmp_path) for ``LLM``."""

from __future__ import annotations

from dataclasses import replace

from tests.engine.utils import ASYNC_SCHED_CONFIG, BAMBA
from tests.models.granitemoehybrid_utils import make_granite_hf
from tests.models.hf_builders import make_nemotron_h_hf, make_zamba2_hf
from tests.models.hybrid_utils import FEW_LAYERS, save_checkpoint
from tests.models.jamba_utils import dummy_config as jamba_config
from tests.models.lfm2_utils import make_lfm2_hf
from tests.models.mamba1_utils import dummy_config as mamba1_config
from tests.models.nemotron_h_moe_utils import make_nemotron_h_moe_hf


def _hf_dir(make, tmp_path, **overrides) -> str:
    return str(save_checkpoint(make(**overrides), tmp_path / "hf"))


# Fewer layers than the model tests' checkpoints, every layer kind kept (FEW_LAYERS); Bamba's
# is this engine config's Mamba2 layer then its attention layer.
BAMBA_SMALL = replace(BAMBA, **FEW_LAYERS["bamba"])


MODELS = {
    "mamba2": lambda tmp: ASYNC_SCHED_CONFIG,
    "bamba": lambda tmp: BAMBA_SMALL,
    # NemotronH (Mamba2, attention and MLP blocks) and Zamba2 (a shared attention block
    # beside its Mamba2 layers), from tiny transformers checkpoints.
    "nemotron_h": lambda tmp: _hf_dir(make_nemotron_h_hf, tmp),
    "zamba2": lambda tmp: _hf_dir(make_zamba2_hf, tmp, **FEW_LAYERS["zamba2"]),
    # Routed experts (FusedMoE: Granite's softmax top-k, NemotronH's grouped sigmoid with
    # relu^2 experts) and LFM2's short conv beside attention.
    "granite_moe": lambda tmp: _hf_dir(make_granite_hf, tmp, **FEW_LAYERS["granite"]),
    "nemotron_h_moe": lambda tmp: _hf_dir(
        make_nemotron_h_moe_hf, tmp, **FEW_LAYERS["nemotron_h_moe"]
    ),
    "lfm2": lambda tmp: _hf_dir(make_lfm2_hf, tmp, **FEW_LAYERS["lfm2"]),
    # Mamba1's selective scan: FalconMamba alone, and Jamba beside attention and experts.
    "falcon_mamba": lambda tmp: mamba1_config("falcon_mamba"),
    "jamba": lambda tmp: jamba_config(**FEW_LAYERS["jamba"]),
}
