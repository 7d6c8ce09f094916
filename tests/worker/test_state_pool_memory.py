"""The Mamba state pool is checked against the GPU's free memory before it is allocated:
a pool that cannot fit is a ValueError naming the options that size it and how many slots
would fit, not an out-of-memory error from deep inside the allocation (an 80 GB H100 with
Codestral-7B's 256 fp32 states met that one). ``CacheEngine`` runs the check on CUDA with
``torch.cuda.mem_get_info``; here the check itself, with Codestral's layer specs."""

from __future__ import annotations

import re

import pytest
import torch

from vllm.cache_spec import MambaStateSpec
from vllm.worker.cache_engine import check_pool_fits

GIB = 2**30


def _codestral(ssm_dtype=torch.float32, layers=64) -> list[MambaStateSpec]:
    # conv over x | B | C (8192 + 2 * 8 groups * 128), width 4; SSM 128 heads x 64 x 128.
    spec = MambaStateSpec((8192 + 2 * 8 * 128, 3), torch.bfloat16, (128, 64, 128), ssm_dtype)
    return [spec] * layers


def test_a_pool_that_fits_passes():
    specs = _codestral()
    need = 257 * sum(s.bytes_per_slot for s in specs)
    check_pool_fits(specs, 256, 0, need, "cuda:0")  # exactly enough


def test_a_pool_too_large_names_the_options_and_what_fits():
    specs = _codestral()
    per_line = sum(s.bytes_per_slot for s in specs)
    free = 64 * GIB
    with pytest.raises(ValueError) as err:
        check_pool_fits(specs, 256, 0, free, "cuda:0")
    text = str(err.value)
    assert "256 sequence slots (max_num_seqs)" in text
    assert f"{257 * per_line / GIB:.2f} GiB on cuda:0" in text
    assert "64.00 GiB is free" in text
    assert (
        "Lower --max-num-seqs, or halve the SSM state with --mamba-ssm-cache-dtype bfloat16" in text
    )
    assert "checkpoint" not in text
    fit = int(re.search(r"(\d+) slots would fit", text).group(1))
    assert (fit + 1) * per_line <= free < (fit + 2) * per_line  # the null line included


def test_checkpoint_lines_are_named_and_a_16_bit_state_gets_no_dtype_hint():
    specs = _codestral(torch.bfloat16)
    with pytest.raises(ValueError) as err:
        check_pool_fits(specs, 256 + 64, 64, 8 * GIB, "cuda:1")
    text = str(err.value)
    assert "256 sequence slots (max_num_seqs) and 64 prefix-cache checkpoint lines" in text
    assert "Lower --max-num-seqs or --num-checkpoint-lines" in text
    assert "mamba-ssm-cache-dtype" not in text
