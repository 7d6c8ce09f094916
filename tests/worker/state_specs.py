"""Codestral-7B's Mamba state specs and a worker's view of an engine config, for the tests
of the state pool's and the checkpoint lines' sizing (test_state_pool_memory.py) and of
their agreement over tensor-parallel ranks (tests/distributed/test_communication.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm.cache_spec import MambaStateSpec

GIB = 2**30


def codestral_specs(ssm_dtype=torch.float32, layers=64) -> list[MambaStateSpec]:
    # conv over x | B | C (8192 + 2 * 8 groups * 128), width 4; SSM 128 heads x 64 x 128.
    spec = MambaStateSpec((8192 + 2 * 8 * 128, 3), torch.bfloat16, (128, 64, 128), ssm_dtype)
    return [spec] * layers


def sizing_config(max_num_seqs: int, enable_prefix_caching: bool | None) -> SimpleNamespace:
    """The fields ``cache_engine.checkpoint_lines_for`` reads, no count given."""
    return SimpleNamespace(
        num_checkpoint_lines=None, block_size=16, ssm_state_dtype=torch.float32,
        max_num_seqs=max_num_seqs, gpu_memory_utilization=0.9,
        enable_prefix_caching=enable_prefix_caching,
    )  # fmt: skip


def codestral_model() -> SimpleNamespace:
    """A model as ``checkpoint_lines_for`` sees it: its cache specs."""
    specs = codestral_specs()
    return SimpleNamespace(get_cache_specs=lambda *a: dict(enumerate(specs)))
