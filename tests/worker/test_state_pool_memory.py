"""The Mamba state pool is checked against the GPU's free memory before it is allocated:
a pool that cannot fit is a ValueError naming the options that size it and how many slots
would fit, not an out-of-memory error from deep inside the allocation (an 80 GB H100 with
Codestral-7B's 256 fp32 states met that one). ``CacheEngine`` runs the check on CUDA with
``torch.cuda.mem_get_info``; here the check itself, with Codestral's layer specs."""

from __future__ import annotations

import re

import pytest
import torch

from tests.worker.state_specs import GIB, codestral_model, codestral_specs, sizing_config
from vllm.worker.cache_engine import auto_checkpoint_lines, check_pool_fits, checkpoint_lines_for


def test_a_pool_that_fits_passes():
    specs = codestral_specs()
    need = 257 * sum(s.bytes_per_slot for s in specs)
    check_pool_fits(specs, 256, 0, need, "cuda:0")  # exactly enough


def test_a_pool_too_large_names_the_options_and_what_fits():
    specs = codestral_specs()
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
    specs = codestral_specs(torch.bfloat16)
    with pytest.raises(ValueError) as err:
        check_pool_fits(specs, 256 + 64, 64, 8 * GIB, "cuda:1")
    text = str(err.value)
    assert "256 sequence slots (max_num_seqs) and 64 prefix-cache checkpoint lines" in text
    assert "Lower --max-num-seqs or --num-checkpoint-lines" in text
    assert "mamba-ssm-cache-dtype" not in text


def test_auto_checkpoint_lines_take_at_most_half_of_what_is_left():
    """Prefix caching with no ``num_checkpoint_lines``: one line per sequence where memory
    allows, fewer where those would take over half of what the GPU has left after the
    weights and the sequences' lines (within gpu_memory_utilization); a CPU: one per
    sequence. Codestral's fp32 line is 259.8 MiB (SSM and conv state)."""
    per_line = sum(s.bytes_per_slot for s in codestral_specs())
    total = 80 * GIB
    # 66 GiB free after the weights: 0.1 of 80 kept back, 65 lines (64 + null) used,
    # ~41.5 GiB left: half of it holds 81 lines, so the 64 sequences get 64.
    assert auto_checkpoint_lines(per_line, 64, 66 * GIB, total, 0.9) == 64
    # 256 sequences (65.2 GiB of lines with the null line) on 141 GiB with 127 free:
    # half of ~47.7 GiB, 94 lines.
    free, total = 127 * GIB, 141 * GIB
    left = free - total * 0.1 - 257 * per_line
    want = int(0.5 * left // per_line)
    assert want == 94
    assert auto_checkpoint_lines(per_line, 256, free, total, 0.9) == want
    # Nothing left after the sequences: no line (the caller refuses caching).
    assert auto_checkpoint_lines(per_line, 256, 60 * GIB, 80 * GIB, 0.9) == 0
    assert auto_checkpoint_lines(per_line, 256, None, 0, 0.9) == 256  # CPU


def test_no_checkpoint_line_that_fits_is_an_error_naming_the_options(monkeypatch):
    """The worker's side (``checkpoint_lines_for``) on a device with too little memory
    left: where caching was asked for, ValueError naming the options, not an engine with
    caching silently off; where it is only the default, off."""
    config = sizing_config(256, True)
    model = codestral_model()
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GIB, 80 * GIB))
    with pytest.raises(ValueError) as err:
        checkpoint_lines_for(model, config, torch.device("cuda:0"))
    text = str(err.value)
    per_line = sum(s.bytes_per_slot for s in codestral_specs())
    assert f"no prefix-cache checkpoint line of {per_line / 2**20:.1f} MiB fits" in text
    assert "256 sequence lines (max_num_seqs)" in text and "--num-checkpoint-lines" in text
    # Not asked for (the default, None): caching is off, with a log line, not an error.
    config.enable_prefix_caching = None
    assert checkpoint_lines_for(model, config, torch.device("cuda:0")) == 0
    # Given, a count is taken as it is; a CPU device gets one line per sequence.
    given = sizing_config(256, True)
    given.num_checkpoint_lines = 7
    assert checkpoint_lines_for(model, given, None) == 7
    assert checkpoint_lines_for(model, config, torch.device("cpu")) == 256
