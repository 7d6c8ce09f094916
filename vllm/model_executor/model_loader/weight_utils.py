"""Reading safetensors checkpoints, and random ("dummy") weights."""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_safetensors_index(index: str | os.PathLike) -> list[str]:
    """The shard file names a ``model.safetensors.index.json`` maps weights to, sorted."""
    index = Path(index)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"{index} is not a safetensors index ({type(err).__name__}: {err}; it must map "
            '"weight_map" names to shard files): download or save it again'
        ) from None
    bad = [n for n in names if not isinstance(n, str) or Path(n).name != n]
    if bad:
        raise ValueError(f"{index} names shards outside its directory: {bad}")
    return names


def safetensors_files(model_dir: str | os.PathLike) -> list[Path]:
    """The checkpoint's safetensors files: the shards its ``model.safetensors.index.json``
    names when it has one (a second copy beside them, such as Mistral's
    consolidated.safetensors, is not read), else every ``*.safetensors``; sorted."""
    model_dir = Path(model_dir)
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        files = [model_dir / name for name in read_safetensors_index(index)]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index} lists shards that are not in {str(model_dir)!r}: "
                f"{', '.join(missing)}; download them again"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {str(model_dir)!r} (use load_format='dummy', "
            "--load-format dummy, for random weights)"
        )
    return files


@contextmanager
def open_safetensors(path: Path):
    """``safe_open`` of one file; a file it cannot read (truncated, not safetensors) is a
    ValueError that names the file, instead of safetensors' bare header message."""
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as err:
        raise ValueError(
            f"{path} is not a readable safetensors file ({err}): it is truncated or "
            "corrupt; download or save it again"
        ) from None
    with handle as f:
        yield f


def check_safetensors_files(model_dir: str | os.PathLike) -> list[Path]:
    """The checkpoint's files, each opened once (its header read, not its tensors), so that
    a missing or broken file fails before any model is built."""
    files = safetensors_files(model_dir)
    for path in files:
        with open_safetensors(path):
            pass
    return files


def iterate_safetensors(model_dir: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of every shard."""
    for path in safetensors_files(model_dir):
        with open_safetensors(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights with the scales of a trained Mamba2, drawn on the parameters' device.

    A stays negative with |A| in [1, 16], dt = softplus(dt_bias) in [1e-3, 0.1] (HF's
    initialisation ranges), norm gains near 1, matrices with unit-variance outputs: finite,
    non-trivial activations at any depth, without touching disk. A parameter with a
    ``full_shape`` (a tensor-parallel shard) draws at that shape and loads its part
    through its ``weight_loader``.

    A fused shard (``qkv_proj`` of q/k/v, ``gate_up_proj``) carries ``dummy_parts``:
    (unfused name, shard id, full shape) per part, each drawn under its world-size-1 name.
    """
    for name, param in model.named_parameters():
        # A tensor-parallel shard draws the full tensor and keeps its part (its loader's),
        # so every tensor-parallel size gets the same weights.
        shape = tuple(getattr(param, "full_shape", param.shape))
        for part, shard_id, part_shape in getattr(param, "dummy_parts", [(name, None, shape)]):
            value = _dummy_value(part, tuple(part_shape), param.device, seed)
            if shard_id is None and tuple(part_shape) == tuple(param.shape):
                param.copy_(value)
            else:
                param.weight_loader(param, value, shard_id)


def _dummy_value(name: str, shape: tuple[int, ...], device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed + zlib.crc32(name.encode()))

    def draw(lo: float, hi: float) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32, device=device)
        return t.uniform_(lo, hi, generator=gen)

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return draw(1.0, 16.0).log()
    if leaf == "dt_bias":
        dt = draw(math.log(1e-3), math.log(1e-1)).exp()
        return dt + torch.log(-torch.expm1(-dt))
    if leaf == "D":
        return draw(0.5, 1.5)
    if name.endswith("conv1d.weight"):
        bound = shape[-1] ** -0.5
        return draw(-bound, bound)
    if leaf == "bias":
        return draw(-0.1, 0.1)
    if len(shape) == 1:  # norm gains
        return draw(0.8, 1.2)
    if "embeddings" in name:
        return draw(-1.0, 1.0)
    bound = math.sqrt(3.0 / shape[1])  # (out, in) matrices
    return draw(-bound, bound)
