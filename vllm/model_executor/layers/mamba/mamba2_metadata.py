"""Per-step metadata of the Mamba2 layers, built once per step and read by every layer.

Built once per step from host data only (query_start_loc, each sequence's state slot,
has_initial_state): nothing is read back from the device. ``prepare`` does the host work and
lists the tensors the device needs (``plan.host``: slots, flags, the chunk layout, the conv
tile map); the model runner uploads them with the rest of its step in ONE non-blocking copy
(``vllm/model_executor/staged_upload.py``) and ``finish`` wraps the device views. ``build``
does all three with the builder's own staging buffer (CUDA-graph buckets, tests). A
metadata object is valid until the next upload into the buffer it views.

Rows of a step fall in three groups, and the layers see them in this canonical order:

1. the decode stream: one-token rows that continue a sequence (real slot, initial state),
   and one-token padded rows (on the null line, ``NULL_BLOCK_ID``; CUDA-graph padding of a
   decode batch);
2. prefills: real rows that are not decodes (fresh prompts, chunked-prefill continuations,
   one-token fresh prompts);
3. other padded rows (zero or several tokens).

When the input is not already in that order (a stable sort by group), ``token_perm`` maps
each canonical token to its input token; the model applies it to the input ids and inverts
it on the output, so every layer only ever sees canonical batches and splits them by slices.
The scheduler can avoid that gather by putting decodes first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vllm.model_executor.layers.mamba.ops.causal_conv1d import NULL_BLOCK_ID, CausalConv1dMetadata
from vllm.model_executor.layers.mamba.ops.causal_conv1d_host import (
    conv1d_metadata_from,
    conv1d_metadata_host,
)
from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import (
    ChunkedScanLayout,
    plan_chunked_scan,
)
from vllm.model_executor.layers.mamba.ops.ssd_combined import SSDChunkLayout, plan_ssd_chunks
from vllm.model_executor.staged_upload import StagedUpload


@dataclass
class Mamba2Metadata:
    """One step's batch, in canonical row order (see the module docstring).

    Counts (host ints): ``num_tokens``, ``batch_size`` (rows, padded ones included),
    ``num_decode_tokens`` (= rows of the decode stream, tokens [0, num_decode_tokens)),
    ``num_prefills`` and ``num_prefill_tokens`` (rows after the decode stream, tokens
    [num_decode_tokens, num_decode_tokens + num_prefill_tokens)); later tokens are padding.

    Device tensors: ``query_start_loc`` (batch+1,) int32, ``state_indices`` (batch,) int32
    (``NULL_BLOCK_ID`` for padded rows), ``has_initial_state`` (batch,) bool,
    ``prefill_query_start_loc`` (num_prefills+1,) int32 relative to the first prefill token,
    ``token_perm`` (num_tokens,) int64 or None. ``conv`` is the conv kernels' metadata for
    the whole canonical batch. The prefills' chunk layout is ONE of ``ssd`` (for the Triton
    SSD, rows absolute in the step: the prefills start at ``num_decode_tokens``) and ``scan``
    (for the PyTorch scan, rows relative to the first prefill token); the other is None.
    Both are None for layers without a chunked scan (Mamba1: a builder without chunk size).
    """

    num_tokens: int
    batch_size: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    query_start_loc_cpu: torch.Tensor
    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    conv: CausalConv1dMetadata
    ssd: SSDChunkLayout | None
    scan: ChunkedScanLayout | None
    token_perm: torch.Tensor | None

    @property
    def decode_only(self) -> bool:
        """Every row is in the decode stream (the conv may use the update op)."""
        return self.num_tokens > 0 and self.num_decode_tokens == self.num_tokens

    @property
    def padded_to_bucket(self) -> bool:
        """A mixed step padded to a CUDA-graph bucket (``mamba2_padded``): the counts are
        the bucket's, and its prefill rows lie inside the S-row decode stream."""
        return False

    @property
    def decode_state_indices(self) -> torch.Tensor:
        return self.state_indices[: self.num_decode_tokens]

    def _prefill_rows(self) -> slice:
        return slice(self.num_decode_tokens, self.num_decode_tokens + self.num_prefills)

    @property
    def prefill_state_indices(self) -> torch.Tensor:
        return self.state_indices[self._prefill_rows()]

    @property
    def prefill_has_initial_state(self) -> torch.Tensor:
        return self.has_initial_state[self._prefill_rows()]


@dataclass
class Mamba2Plan:
    """The host half of a step's metadata (``Mamba2MetadataBuilder.prepare``): ``host``
    name -> CPU tensor to upload, the chunk layout with host tensors, the conv metadata's
    host fields, and the row counts."""

    host: dict[str, torch.Tensor]
    layout: SSDChunkLayout | ChunkedScanLayout
    conv_fields: dict
    counts: dict[str, int]


def _check_host(name: str, t, dtype: torch.dtype, length: int | None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor (host data), got {type(t).__name__}")
    if t.dim() != 1 or t.dtype != dtype:
        raise ValueError(f"{name} must be 1-D {dtype}, got shape {tuple(t.shape)} {t.dtype}")
    if length is not None and t.numel() != length:
        raise ValueError(f"{name} must have {length} entries, got {t.numel()}")
    return t


class Mamba2MetadataBuilder:
    """Builds ``Mamba2Metadata`` once per step; owns the device buffers reused across steps.

    ``chunk_size`` is the model's scan chunk (``config.chunk_size``), shared by all layers;
    None for a model whose layers scan without chunks (Mamba1): no chunk layout is planned.
    ``triton_ssd`` picks the prefills' scan, and so which layout the metadata carries: the
    Triton SSD (``ops/ssd_combined``) or the PyTorch ``chunk_scan_varlen``. None: the Triton
    SSD on CUDA, the PyTorch scan on CPU (the CPU path; True there needs the interpreter).
    """

    def __init__(
        self, chunk_size: int | None, device: torch.device | str, triton_ssd: bool | None = None
    ):
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self.device = torch.device(device)
        self.triton_ssd = self.device.type == "cuda" if triton_ssd is None else bool(triton_ssd)
        self._staging = StagedUpload(self.device)
        self.num_builds = 0

    @property
    def staging(self) -> StagedUpload:
        return self._staging

    def build(
        self,
        query_start_loc_cpu: torch.Tensor,
        state_indices_cpu: torch.Tensor,
        has_initial_state_cpu: torch.Tensor,
    ) -> Mamba2Metadata:
        """The step's metadata from host tensors, uploaded by the builder's own staging
        (one copy). The model runner instead calls ``prepare``, uploads ``plan.host`` with
        the rest of its step, and calls ``finish``.

        ``query_start_loc_cpu`` (batch+1,) int32 offsets from 0; ``state_indices_cpu``
        (batch,) int32 slots (pool lines >= 1), ``NULL_BLOCK_ID`` (line 0) or
        ``PAD_SLOT_ID`` for padded rows (both become ``NULL_BLOCK_ID``), distinct otherwise;
        ``has_initial_state_cpu`` (batch,) bool: the row continues its slot's state.
        """
        plan = self.prepare(query_start_loc_cpu, state_indices_cpu, has_initial_state_cpu)
        return self.finish(plan, self._staging.upload(plan.host))

    def prepare(
        self,
        query_start_loc_cpu: torch.Tensor,
        state_indices_cpu: torch.Tensor,
        has_initial_state_cpu: torch.Tensor,
    ) -> Mamba2Plan:
        """The host half of ``build`` (same arguments): checks, canonical order, chunk
        layout, conv tile map; ``plan.host`` holds the tensors the device needs."""
        qsl = _check_host("query_start_loc_cpu", query_start_loc_cpu, torch.int32, None)
        if qsl.numel() < 1 or int(qsl[0]) != 0:
            raise ValueError("query_start_loc_cpu must start at 0")
        batch = qsl.numel() - 1
        slots = _check_host("state_indices_cpu", state_indices_cpu, torch.int32, batch)
        init = _check_host("has_initial_state_cpu", has_initial_state_cpu, torch.bool, batch)
        lens = qsl[1:] - qsl[:-1]
        if bool((lens < 0).any()):
            raise ValueError("query_start_loc_cpu must be non-decreasing")
        # A negative slot (PAD_SLOT_ID) names no line: a padded row, sent to the null line
        # like the others, so every op sees one marker.
        is_pad = (slots == NULL_BLOCK_ID) | (slots < 0)
        real = slots[~is_pad]
        if real.unique().numel() != real.numel():
            raise ValueError(
                "state_indices_cpu must hold distinct slots >= 1 (NULL_BLOCK_ID = 0, the null "
                f"line, or PAD_SLOT_ID for padded rows), got {slots.tolist()}"
            )
        slots = torch.where(is_pad, NULL_BLOCK_ID, slots)

        one = lens == 1
        in_decode_stream = one & (is_pad | init)
        group = torch.where(in_decode_stream, 0, torch.where(is_pad, 2, 1))
        order = torch.sort(group, stable=True).indices
        canonical = bool((order == torch.arange(batch)).all())
        num_tokens = int(qsl[-1])
        if canonical:
            qsl_c, slots_c, init_c, lens_c = qsl.clone(), slots, init, lens
        else:
            lens_c, slots_c, init_c = lens[order], slots[order], init[order]
            qsl_c = torch.zeros(batch + 1, dtype=torch.int32)
            torch.cumsum(lens_c, 0, out=qsl_c[1:])
        num_decode = int(in_decode_stream.sum())
        num_prefills = int((group == 1).sum())
        prefill_lens = lens_c[num_decode : num_decode + num_prefills]
        prefill_rows = qsl_c[num_decode : num_decode + num_prefills + 1]
        prefill_qsl = prefill_rows - qsl_c[num_decode]
        if self.chunk_size is None:
            layout = None
        elif self.triton_ssd:
            layout = plan_ssd_chunks(prefill_rows, self.chunk_size)
        else:
            layout = plan_chunked_scan(prefill_lens, self.chunk_size)
        fields = () if layout is None else layout.TENSOR_FIELDS

        host = {
            "state_indices": slots_c,
            "has_initial_state": init_c,
            "prefill_query_start_loc": prefill_qsl,
        }
        host.update({f"layout.{name}": getattr(layout, name) for name in fields})
        if not canonical:
            # A canonical row keeps its tokens in order: each moves by the row's start shift.
            shift = (qsl[:-1][order] - qsl_c[:-1]).long()
            host["token_perm"] = torch.arange(num_tokens) + torch.repeat_interleave(
                shift, lens_c.long()
            )
        conv_host, conv_fields = conv1d_metadata_host(qsl_c)
        host.update({f"conv.{name}": t for name, t in conv_host.items()})
        return Mamba2Plan(
            host=host,
            layout=layout,
            conv_fields=conv_fields,
            counts=dict(
                num_tokens=num_tokens,
                batch_size=batch,
                num_decode_tokens=num_decode,
                num_prefills=num_prefills,
                num_prefill_tokens=int(prefill_lens.sum()),
            ),
        )

    def finish(self, plan: Mamba2Plan, dev: dict[str, torch.Tensor]) -> Mamba2Metadata:
        """The metadata of ``plan`` from the device copies of ``plan.host`` (same names;
        more names may be there)."""
        layout, common = finish_common(plan, dev)
        self.num_builds += 1
        return Mamba2Metadata(
            **common,
            ssd=layout if self.triton_ssd else None,
            scan=None if self.triton_ssd else layout,
            token_perm=dev.get("token_perm") if "token_perm" in plan.host else None,
        )


def finish_common(plan: Mamba2Plan, dev: dict[str, torch.Tensor]) -> tuple:
    """(the chunk layout on the device, the metadata's fields every step has) from the
    device copies of ``plan.host``: ``Mamba2MetadataBuilder.finish`` and the CUDA graphs'
    padded metadata (``mamba2_padded``) share it."""
    layout = plan.layout
    if layout is not None:
        layout = replace(layout, **{n: dev[f"layout.{n}"] for n in layout.TENSOR_FIELDS})
    conv = conv1d_metadata_from(
        plan.conv_fields, {n: dev[f"conv.{n}"] for n in ("query_start_loc", "tile_seq")}
    )
    common = dict(
        **plan.counts,
        query_start_loc_cpu=plan.conv_fields["query_start_loc_cpu"],
        query_start_loc=conv.query_start_loc,
        state_indices=dev["state_indices"],
        has_initial_state=dev["has_initial_state"],
        prefill_query_start_loc=dev["prefill_query_start_loc"],
        conv=conv,
    )
    return layout, common


def check_layer_inputs(where: str, hidden_states, hidden_size: int, md) -> None:
    """A Mamba-family layer's step inputs: the forward context's ``Mamba2Metadata`` and
    (num_tokens, hidden_size) hidden states of its token count; errors name ``where``."""
    if not isinstance(md, Mamba2Metadata):
        raise RuntimeError(
            f"{where}: the forward context carries no Mamba2Metadata (got "
            f"{type(md).__name__}); the model runner builds one per step"
        )
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden_size:
        raise ValueError(
            f"{where}: hidden_states must be (num_tokens, {hidden_size}), "
            f"got {tuple(hidden_states.shape)}"
        )
    if md.num_tokens != hidden_states.shape[0]:
        raise ValueError(
            f"{where}: metadata was built for {md.num_tokens} tokens, "
            f"hidden_states has {hidden_states.shape[0]}"
        )
