"""Helpers shared by the causal-conv1d tests: input builders and the tolerance table.

Inputs are drawn on the CPU from a generator seeded by the case id, then moved to
the device, so a case has the same data on the CPU box and on the GPU box.
"""

from __future__ import annotations

import zlib

import torch

# The ONE tolerance table: outputs of the kernels vs the fp32 reference, keyed by the
# output (= x) dtype. Both compute in fp32 and cast once, so the budget is about one
# unit in the last place of the output dtype. States are compared with torch.equal.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def gen_for(*key) -> torch.Generator:
    """A CPU generator seeded from ``key`` (e.g. the case id)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(shape, gen, dtype, device, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=gen)).to(dtype=dtype, device=device)


def make_x(dim, num_tokens, dtype, device, gen, noncontig: bool = False) -> torch.Tensor:
    """x (dim, num_tokens) with stride(0) == 1.

    ``noncontig`` takes x as a slice of a wider (num_tokens, width) projection, as the
    layer does (token stride > dim, non-zero storage offset).
    """
    if noncontig:
        proj = randn((num_tokens, dim + 40), gen, dtype, device)
        return proj[:, 24 : 24 + dim].t()
    return randn((num_tokens, dim), gen, dtype, device).t()


def make_pool(num_lines, dim, state_len, dtype, device, gen) -> torch.Tensor:
    """The state pool (num_lines, dim, state_len), feature-contiguous (stride(1) == 1)."""
    return randn((num_lines, state_len, dim), gen, dtype, device).transpose(1, 2)


def make_weight(dim, width, dtype, device, gen) -> torch.Tensor:
    return randn((dim, width), gen, dtype, device, scale=0.5)


def make_bias(dim, dtype, device, gen) -> torch.Tensor:
    return randn((dim,), gen, dtype, device, scale=0.2)


def qsl_from_lens(seqlens, device) -> torch.Tensor:
    qsl = [0]
    for n in seqlens:
        qsl.append(qsl[-1] + n)
    return torch.tensor(qsl, dtype=torch.int32, device=device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Kernel output vs reference, with the table's tolerance for the output dtype."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, **TOLERANCES[expected.dtype], msg=msg or None)


def assert_no_nan(t: torch.Tensor) -> None:
    assert not torch.isnan(t).any(), "output has NaN: an element was left unwritten"


def i32(values, device) -> torch.Tensor:
    """An int32 tensor (cache lines, accepted counts) of ``values`` on ``device``."""
    return torch.tensor(values, dtype=torch.int32, device=device)


def flags(values, device) -> torch.Tensor:
    """A bool tensor (has_initial_state) of ``values`` on ``device``."""
    return torch.tensor(values, dtype=torch.bool, device=device)
