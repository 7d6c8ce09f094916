"""Reading safetensors checkpoints lazily, the one weight-loading loop, and random
("dummy") weights.

A checkpoint is read as (name, ``CheckpointSlice``) pairs (``iterate_checkpoint_slices``):
each slice knows its tensor's full shape and reads from the file only what is indexed. A
model's ``load_weights`` hands the pairs to ``load_model_weights``, which maps each name
to a parameter (the model's name map, then its ``stacked_params_mapping``: a checkpoint's
``q_proj`` is part "q" of our ``qkv_proj``) and calls the parameter's ``weight_loader``
(``layers/linear.py`` and the others), which reads this rank's rows or columns only. At
world size 1 those are the whole tensor: one path at every world size.

Dummy weights are a random checkpoint of the model's own shapes (``dummy_weights``) loaded
the same way, so every world size gets the weights of world size 1.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from vllm.model_executor.layers.linear import WeightShapeError, replicated_weight_loader

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


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointSlice:
    """One tensor of an open safetensors file, read on indexing only.

    ``shape`` and ``dtype`` are the full tensor's; ``self[i0, i1, ...]`` with one slice (or
    int) per dimension reads that region from the file and returns a CPU tensor;
    ``bytes_read`` adds up what indexing has read. Valid while its file is open (during
    the iteration step of ``iterate_checkpoint_slices`` that yielded it).
    """

    def __init__(self, name: str, safe_slice):
        self.name = name
        self._slice = safe_slice
        self.shape = tuple(safe_slice.get_shape())
        self.dtype = _SAFETENSORS_DTYPES.get(safe_slice.get_dtype())
        self.bytes_read = 0

    def __getitem__(self, index) -> torch.Tensor:
        if not isinstance(index, tuple):
            index = (index,)
        if any(not isinstance(i, (slice, int)) for i in index):
            raise TypeError(f"{self.name}: index by slices or ints, got {index!r}")
        tensor = self._slice[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def full(self) -> torch.Tensor:
        """The whole tensor."""
        return self[tuple(slice(None) for _ in self.shape)]

    def __repr__(self) -> str:
        return f"CheckpointSlice({self.name!r}, shape={self.shape}, dtype={self.dtype})"


def iterate_checkpoint_slices(
    model_dir: str | os.PathLike,
) -> Iterator[tuple[str, CheckpointSlice]]:
    """(name, lazy slice) for every tensor of every shard; nothing is read until a slice
    is indexed."""
    for path in safetensors_files(model_dir):
        with open_safetensors(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, CheckpointSlice(name, f.get_slice(name))


# (our module, the checkpoint's module, shard id): ("qkv_proj", "q_proj", "q") says a
# checkpoint's ``...q_proj.weight`` is part "q" of our ``...qkv_proj.weight``.
StackedParamsMapping = Sequence[tuple[str, str, str | int]]


def stacked_target(name: str, mapping: StackedParamsMapping) -> tuple[str, str | int | None]:
    """(our parameter name, shard id) of a checkpoint parameter name: one whose module is
    a mapping's checkpoint module becomes that part of our fused module; any other is
    itself, whole (shard id None)."""
    parts = name.split(".")
    for ours, theirs, shard_id in mapping:
        if len(parts) >= 2 and parts[-2] == theirs:
            return ".".join([*parts[:-2], ours, parts[-1]]), shard_id
    return name, None


@torch.no_grad()
def load_model_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, object]],
    to_param_name: Callable[[str], str | tuple[str, object] | None] = lambda name: name,
    stacked_params_mapping: StackedParamsMapping = (),
) -> None:
    """Load a checkpoint's (name, full tensor or ``CheckpointSlice``) pairs into ``model``,
    each through its parameter's ``weight_loader`` (a whole-tensor copy where it has none).

    ``to_param_name`` maps a checkpoint name to ours (None: a tensor to skip); then
    ``stacked_params_mapping`` makes a fused layer's part (name, shard id). It may also
    return the (name, shard id) pair itself (an expert's tensor in a ``FusedMoE``'s stacked
    weights: the expert is part of the shard id). Several
    checkpoint names may reach one parameter (part): the copies of a shared weight
    (Zamba2's blocks, tied weights). The first is loaded; each later one is read the same
    way (this rank's rows only) into a scratch copy and must equal what is there. Raises
    ValueError naming the checkpoint tensor for a shape that does not fit, for names the
    model does not know, for copies of a shared parameter that differ, and for
    parameters (or parts of a fused one) no tensor reached.
    """
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}
    first_source: dict[tuple[str, object], str] = {}
    unknown: list[str] = []
    for ckpt_name, weight in weights:
        mapped = to_param_name(ckpt_name)
        if mapped is None:
            continue
        if isinstance(mapped, tuple):
            name, shard_id = mapped
        else:
            name, shard_id = stacked_target(mapped, stacked_params_mapping)
        param = params.get(name)
        if param is None:
            unknown.append(ckpt_name)
            continue
        loader = getattr(param, "weight_loader", replicated_weight_loader)
        first = first_source.get((name, shard_id))
        dst = param if first is None else param.detach().clone()
        try:
            loader(dst, weight, shard_id)
        except WeightShapeError as err:
            raise ValueError(
                f"weight {ckpt_name!r} has shape {err.got} in the checkpoint, but the config "
                f"makes {name!r} expect {err.expected}: the weights do not belong to this "
                "config.json"
            ) from None
        except ValueError as err:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} -> {name!r}: {err}") from None
        if first is not None:
            if not torch.equal(dst, param):
                raise ValueError(
                    f"checkpoint weights {first!r} and {ckpt_name!r} are copies of the "
                    f"shared parameter {name!r} but differ"
                )
            continue
        first_source[(name, shard_id)] = ckpt_name
        loaded.setdefault(name, set()).add(shard_id)
    if unknown:
        raise ValueError(f"checkpoint has weights this model does not know: {sorted(unknown)}")
    missing = sorted(_missing(params, loaded))
    if missing:
        raise ValueError(f"checkpoint lacks weights the model needs: {missing}")


def _missing(params: dict[str, nn.Parameter], loaded: dict[str, set]) -> Iterator[str]:
    """Parameters no tensor reached, and the parts of fused ones (``name[shard id]``)."""
    for name, param in params.items():
        got = loaded.get(name, set())
        if None in got:
            continue
        parts = getattr(param, "shard_shapes", {})
        if not got:
            yield name
        else:
            yield from (f"{name}[{sid!r}]" for sid in parts if sid not in got)


def dummy_weights(model: nn.Module, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """A random checkpoint of ``model``: (name, full tensor) for every tensor its
    checkpoint holds, on the parameters' device. Names are the parameters' own, a fused
    parameter's parts under the checkpoint modules its ``stacked_params_mapping`` names
    (``q_proj``, ...); shapes are the full ones (``full_shape``, ``shard_shapes``), so
    every world size draws the same tensors and loads its part of them.

    Values have the scales of a trained Mamba2: A stays negative with |A| in [1, 16], dt =
    softplus(dt_bias) in [1e-3, 0.1] (HF's initialisation ranges), norm gains near 1,
    matrices with unit-variance outputs: finite, non-trivial activations at any depth.
    Each tensor is drawn from a generator seeded by ``seed`` and its name.
    """
    mapping = getattr(model, "stacked_params_mapping", ())
    for name, param in model.named_parameters():
        parts = name.split(".")
        shard_shapes = getattr(param, "shard_shapes", {})
        stacked = [
            (theirs, shard_id)
            for ours, theirs, shard_id in mapping
            if len(parts) >= 2 and parts[-2] == ours and shard_id in shard_shapes
        ]
        if not stacked:
            shape = tuple(getattr(param, "full_shape", param.shape))
            yield name, _dummy_value(name, shape, param.device, seed)
        for theirs, shard_id in stacked:
            part = ".".join([*parts[:-2], theirs, parts[-1]])
            yield part, _dummy_value(part, tuple(shard_shapes[shard_id]), param.device, seed)


def initialize_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Load ``dummy_weights(model, seed)`` through the model's ``load_weights``."""
    model.load_weights(dummy_weights(model, seed))


def _dummy_value(name: str, shape: tuple[int, ...], device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed + zlib.crc32(name.encode()))

    def draw(lo: float, hi: float) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32, device=device)
        return t.uniform_(lo, hi, generator=gen)

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return draw(1.0, 16.0).log()
    if leaf == "dt_bias" or name.endswith("dt_proj.bias"):  # Mamba2's, Mamba1's
        dt = draw(math.log(1e-3), math.log(1e-1)).exp()
        return dt + torch.log(-torch.expm1(-dt))
    if leaf == "D":
        return draw(0.5, 1.5)
    if name.endswith("conv1d.weight"):
        bound = shape[-1] ** -0.5
        return draw(-bound, bound)
    if leaf == "bias":
        return draw(-0.1, 0.1)
    if leaf == "e_score_correction_bias":  # a router's choice bias: small, so the random
        return draw(-0.01, 0.01)  # router spreads tokens over all experts (benchmarks)
    if len(shape) == 1:  # norm gains
        return draw(0.8, 1.2)
    if "embeddings" in name:
        return draw(-1.0, 1.0)
    bound = math.sqrt(3.0 / shape[-1])  # (out, in) matrices, (experts, out, in) stacks
    return draw(-bound, bound)
