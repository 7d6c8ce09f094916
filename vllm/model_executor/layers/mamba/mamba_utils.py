"""The Mamba state pool (Mamba2's and Mamba1's): sizes, conv layout per backend, allocator.

One function, ``mamba2_state_spec``, gives the per-slot state sizes of a Mamba2 layer;
``MambaMixer2`` checks the tensors it is handed against it and ``MambaStatePool`` allocates
with it, so the two cannot disagree.

The conv-state layout follows the conv backend (``VLLM_USE_TRITON_CONV1D``):

- Triton: feature-contiguous, a (lines, dim, W-1) view with ``stride(1) == 1`` (allocated
  as (lines, W-1, dim) and transposed), which the Triton kernels read coalesced;
- CUDA: width-contiguous, (lines, dim, W-1) contiguous, as the CUDA ops expect.

A pool has ``num_slots + 1`` lines per layer. Line 0 is the null line (upstream's
``NULL_BLOCK_ID``): padded rows point there, the ops' default marker makes them read and
write no line, and nothing reads it back. Sequences own lines 1 .. num_slots (a slot is its
line's number), so the null line costs one line, never a slot.

The engine binds each Mamba layer's views of the pool to the layer (``bind_kv_cache``:
``layer.kv_cache = pool.layer(i)``); a model's forward never sees the pool.

With replayed decode (``replay_len`` L > 0, ``use_replayssm``) the pool also holds, per
layer and line, the ring of L-1 buffered decode steps and its counters
(``ops/mamba_ssm_replay``), and ``layer(i)`` hands the layer a ``ReplayedSSMState`` in place
of the bare SSM-state view; the layer then runs the replayed update.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from vllm import envs
from vllm.cache_spec import MambaStateSpec
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID
from vllm.model_executor.layers.mamba.ops.mamba_ssm_replay_ref import ReplayedSSMState

# The replay buffers, in ``ReplayedSSMState``'s order after the state.
RING_NAMES = ("ring_x", "ring_B", "ring_dt", "count")


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba2 mixer's sizes and settings under one set of names: each model config's
    ``mamba_shape()`` reads its own fields into it, ``MambaMixer2`` is built from it and
    the tensor-parallel check reads it. Sizes are the whole layer's (all ranks)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    use_bias: bool
    use_conv_bias: bool
    norm_eps: float
    time_step_limit: tuple[float, float]

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class Mamba2StateSpec:
    """Per-slot state sizes of one Mamba2 layer."""

    conv_dim: int
    conv_state_len: int
    num_heads: int
    head_dim: int
    state_size: int

    @property
    def conv_shape(self) -> tuple[int, int]:
        """(dim, W-1), the logical shape of one conv-state line."""
        return (self.conv_dim, self.conv_state_len)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        """(nheads, headdim, dstate), one SSM-state line."""
        return (self.num_heads, self.head_dim, self.state_size)

    @property
    def n_groups(self) -> int:
        return (self.conv_dim - self.num_heads * self.head_dim) // (2 * self.state_size)


def mamba2_state_spec(
    *,
    num_heads: int,
    head_dim: int,
    state_size: int,
    n_groups: int,
    conv_kernel: int,
) -> Mamba2StateSpec:
    """The per-slot state sizes of a Mamba2 layer (the conv runs over x | B | C)."""
    intermediate_size = num_heads * head_dim
    return Mamba2StateSpec(
        conv_dim=intermediate_size + 2 * n_groups * state_size,
        conv_state_len=conv_kernel - 1,
        num_heads=num_heads,
        head_dim=head_dim,
        state_size=state_size,
    )


class ConvBackend(enum.Enum):
    TRITON = "triton"
    CUDA = "cuda"


def conv_backend_from_env() -> ConvBackend:
    """The backend ``VLLM_USE_TRITON_CONV1D`` asks for (read now, from vllm.envs)."""
    return ConvBackend.TRITON if envs.VLLM_USE_TRITON_CONV1D else ConvBackend.CUDA


def load_cuda_conv_ops():
    """``vllm._custom_ops``, checked to have the CUDA conv ops built; RuntimeError otherwise.

    Imported here, lazily, so the Triton backend never needs the module.
    """
    hint = (
        "VLLM_USE_TRITON_CONV1D=0 selects the CUDA causal-conv1d ops, but {why}. Build "
        "them on a machine with a CUDA build of torch, nvcc and cmake (`VLLM_BUILD_CUDA_OPS=1 "
        "pip install --no-deps --no-build-isolation -e .`), or set VLLM_USE_TRITON_CONV1D=1 "
        "for the Triton ops, which need no build."
    )
    try:
        from vllm import _custom_ops as ops
    except ImportError as err:
        raise RuntimeError(hint.format(why=f"vllm._custom_ops cannot be imported ({err})")) from err
    available = getattr(ops, "cuda_ops_available", None)
    if available is None or not available():
        raise RuntimeError(hint.format(why="vllm._custom_ops reports them not built"))
    return ops


def allocate_conv_state(
    num_lines: int,
    spec: Mamba2StateSpec,
    backend: ConvBackend,
    dtype: torch.dtype,
    device: torch.device | str,
    num_layers: int | None = None,
) -> torch.Tensor:
    """Zeroed conv states (``[num_layers,] num_lines, dim, W-1``) in the backend's layout."""
    lead = () if num_layers is None else (num_layers,)
    dim, state_len = spec.conv_shape
    if backend is ConvBackend.TRITON:
        return torch.zeros(*lead, num_lines, state_len, dim, dtype=dtype, device=device).transpose(
            -1, -2
        )
    return torch.zeros(*lead, num_lines, dim, state_len, dtype=dtype, device=device)


def check_conv_state_layout(conv_state: torch.Tensor, backend: ConvBackend) -> None:
    """Raise ValueError when a conv-state tensor is not in the backend's layout."""
    if backend is ConvBackend.TRITON:
        if conv_state.stride(-2) != 1:
            raise ValueError(
                "the Triton conv backend needs a feature-contiguous conv state "
                f"(stride(1) == 1), got strides {conv_state.stride()}; allocate the pool "
                "under the same VLLM_USE_TRITON_CONV1D as the model"
            )
    elif not conv_state.is_contiguous():
        raise ValueError(
            "the CUDA conv backend needs a width-contiguous (contiguous) conv state, got "
            f"strides {conv_state.stride()}; allocate the pool under the same "
            "VLLM_USE_TRITON_CONV1D as the model"
        )


class MambaStatePool:
    """Conv and SSM state of every Mamba layer for ``num_slots`` sequences, on lines 1 ..
    num_slots, line 0 being the null line.

    ``conv_state``: (num_layers, num_slots + 1, dim, W-1) in the backend's layout;
    ``ssm_state``: (num_layers, num_slots + 1, *spec.ssm_shape): (nheads, headdim, dstate)
    for Mamba2, (d_inner, dstate) for Mamba1 (``spec``: anything with ``conv_shape`` and
    ``ssm_shape``); with ``replay_len`` L > 0 (Mamba2 only) also ``rings`` (name ->
    (num_layers, num_slots + 1, ...): the ring of L-1 steps, x and B in the conv dtype (the
    activations'), and the counters). ``layer(i)`` gives layer
    i's pair of views (the SSM one a ``ReplayedSSMState`` with replay), which the layer
    updates in place.
    """

    def __init__(
        self,
        spec: Mamba2StateSpec | MambaStateSpec,
        num_layers: int,
        num_slots: int,
        backend: ConvBackend,
        conv_dtype: torch.dtype,
        ssm_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        replay_len: int = 0,
    ):
        if replay_len and replay_len < 2:
            raise ValueError(
                f"replay_len (replayssm_buffer_len) must be 0 or >= 2, got {replay_len}"
            )
        if num_slots < 1 or num_layers < 1:
            raise ValueError(
                f"need num_slots >= 1 and num_layers >= 1, got {num_slots}, {num_layers}"
            )
        self.spec = spec
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.backend = backend
        lines = num_slots + 1
        self.conv_state = allocate_conv_state(lines, spec, backend, conv_dtype, device, num_layers)
        self.ssm_state = torch.zeros(
            num_layers, lines, *spec.ssm_shape, dtype=ssm_dtype, device=device
        )
        self.replay_len = replay_len
        slot = MambaStateSpec(spec.conv_shape, conv_dtype, spec.ssm_shape, ssm_dtype, replay_len)
        self.rings = {
            name: torch.zeros(num_layers, lines, *shape, dtype=dtype, device=device)
            for name, (shape, dtype) in slot.ring_shapes.items()
        }

    @classmethod
    def from_specs(
        cls,
        specs: list[MambaStateSpec],
        num_slots: int,
        backend: ConvBackend,
        device: torch.device | str = "cpu",
    ) -> MambaStatePool:
        """The pool of the Mamba layers ``specs`` describe (``get_cache_specs``' Mamba
        entries, in the model's layer order: pool layer i is ``specs[i]``'s layer). The
        layers of one model share one shape, so they stack into one tensor per state."""
        if not specs:
            raise ValueError("no Mamba layer specs: a model without Mamba layers has no pool")
        first = specs[0]
        if any(s != first for s in specs):
            differ = sorted(set(map(str, specs)))
            raise ValueError(f"the Mamba layers' state specs differ: {differ}")
        spec = first
        if len(first.ssm_shape) == 3:  # Mamba2; other layers' specs serve as they are
            conv_dim, conv_len = first.conv_shape
            num_heads, head_dim, state_size = first.ssm_shape
            spec = Mamba2StateSpec(conv_dim, conv_len, num_heads, head_dim, state_size)
        if first.replay_dtype not in (None, first.conv_dtype):
            raise ValueError("the replay ring keeps the activations' dtype, the conv state's")
        return cls(
            spec,
            len(specs),
            num_slots,
            backend,
            first.conv_dtype,
            first.ssm_dtype,
            device,
            first.replay_len,
        )

    @property
    def pad_line(self) -> int:
        """The null line padded rows point at (not a slot): ``NULL_BLOCK_ID``."""
        return NULL_BLOCK_ID

    @property
    def slots(self) -> range:
        """The lines sequences may own: 1 .. num_slots."""
        return range(NULL_BLOCK_ID + 1, self.num_slots + 1)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor | ReplayedSSMState]:
        if not self.rings:
            return self.conv_state[i], self.ssm_state[i]
        rings = (self.rings[name][i] for name in RING_NAMES)
        return self.conv_state[i], ReplayedSSMState(self.ssm_state[i], *rings)

    def zero_slots(self, num_slots: int) -> None:
        """Zero the states of the first ``num_slots`` slots (lines 1 .. num_slots) and empty
        their rings."""
        lines = slice(1, num_slots + 1)
        self.conv_state[:, lines].zero_()
        self.ssm_state[:, lines].zero_()
        if self.rings:
            self.rings["count"][:, lines].zero_()

    def copy_line(self, src: int, dst: int) -> None:
        """Copy line ``src``'s states into line ``dst`` in every layer, the replay ring and
        its counters included (so a replayed line needs no materialising first)."""
        lines = self.num_slots + 1
        for name, line in (("src", src), ("dst", dst)):
            if isinstance(line, bool) or not isinstance(line, int) or not 1 <= line < lines:
                raise ValueError(f"{name} must be a line in 1 .. {lines - 1}, got {line!r}")
        for t in (self.conv_state, self.ssm_state, *self.rings.values()):
            t[:, dst].copy_(t[:, src])

    def clone(self) -> MambaStatePool:
        """A deep copy with the same layout (strides kept)."""
        twin = object.__new__(MambaStatePool)
        twin.__dict__.update(self.__dict__)
        twin.conv_state = torch.empty_like(self.conv_state).copy_(self.conv_state)
        twin.ssm_state = self.ssm_state.clone()
        twin.rings = {name: t.clone() for name, t in self.rings.items()}
        return twin

    def ring_nbytes(self) -> int:
        """Bytes of the replay buffers (0 without replay)."""
        return sum(t.numel() * t.element_size() for t in self.rings.values())

    def nbytes(self) -> int:
        states = sum(t.numel() * t.element_size() for t in (self.conv_state, self.ssm_state))
        return states + self.ring_nbytes()
