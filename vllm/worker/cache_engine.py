"""CacheEngine: the engine side of the caches a model describes.

The model gives per-layer specs (``model.get_cache_specs(block_size, ssm_dtype)``: module
name -> ``MambaStateSpec`` | ``AttentionSpec``, in layer order); the engine allocates:

- the Mamba state pool: every Mamba layer's conv and SSM state for ``max_num_seqs`` slots
  on lines 1 .. max_num_seqs (line 0 is the null line padded rows point at), one
  ``MambaStatePool`` in the conv backend's layout, layer i of the pool being the i-th Mamba
  spec's; each layer gets its views bound to ``kv_cache`` (``bind_kv_cache``). With
  ``replayssm_buffer_len`` L > 0 (replayed decode) every Mamba spec carries the ring of L-1
  buffered steps, so the pool's size (and what the KV cache is sized after) includes it;
- the paged KV cache: per attention layer a (2, num_blocks, block_size, num_kv_heads,
  head_size) tensor of its spec's dtype, bound to that layer's ``kv_cache`` attribute.
  It is a view of a block-major (num_blocks, 2, ...) allocation: K and V of a block sit
  together, and no stride depends on the block count, so the small cache of the start-up
  steps and the sized one select the same kernel variants (Triton specialises integer
  arguments, strides included, on their size class).
  ``num_kv_blocks`` sizes it from a memory budget (``gpu_memory_utilization``) or takes the
  configured count; ``allocate_kv`` may run twice (a small cache for the start-up steps,
  then the sized one), rebinding every layer.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from vllm.cache_spec import AttentionSpec, MambaStateSpec
from vllm.distributed import min_over_ranks
from vllm.logger import init_logger
from vllm.model_executor.layers.mamba.mamba_utils import MambaStatePool
from vllm.model_executor.layers.mamba.ops.mamba_ssm_replay import default_on
from vllm.model_executor.models.utils import bind_kv_cache, bind_state_pool

logger = init_logger(__name__)

# CPU KV cache budget when neither the override nor a GPU sizes it (vLLM's CPU default).
CPU_KV_CACHE_BYTES = 4 << 30


def line_bytes(specs) -> int:
    """One state-pool line: every Mamba spec's slot (conv, SSM, replay ring)."""
    return sum(spec.bytes_per_slot for spec in specs)


def check_pool_fits(specs, num_slots: int, num_checkpoint_lines: int, free_bytes: int,
                    device) -> None:  # fmt: skip
    """ValueError, naming the options that size it, when the Mamba state pool of ``specs``
    (``num_slots`` slots, ``num_checkpoint_lines`` of them prefix-cache checkpoint lines,
    plus the null line) cannot fit in ``free_bytes``: the allocation would fail with an
    out-of-memory error that names neither."""
    per_line = line_bytes(specs)
    need = (num_slots + 1) * per_line
    if need <= free_bytes:
        return
    fit = max(free_bytes // per_line - 1, 0)
    what = f"{num_slots - num_checkpoint_lines} sequence slots (max_num_seqs)"
    knobs = "--max-num-seqs"
    if num_checkpoint_lines:
        what += f" and {num_checkpoint_lines} prefix-cache checkpoint lines (num_checkpoint_lines)"
        knobs += " or --num-checkpoint-lines"
    hint = ""
    if any(spec.ssm_dtype == torch.float32 for spec in specs):
        hint = ", or halve the SSM state with --mamba-ssm-cache-dtype bfloat16"
    raise ValueError(
        f"the Mamba state pool needs {need / 2**30:.2f} GiB on {device} for {what} and the "
        f"null line, {per_line / 2**20:.1f} MiB each over {len(specs)} layers, but "
        f"{free_bytes / 2**30:.2f} GiB is free after the weights: {fit} slots would fit. "
        f"Lower {knobs}{hint}"
    )


# With prefix caching on and no ``num_checkpoint_lines`` given, the checkpoint lines take
# at most this share of the GPU memory left, within ``gpu_memory_utilization``, after the
# weights and the sequences' lines: the rest stays for the activations, the CUDA graphs
# and, in a hybrid, the KV cache (sized after the pool).
CHECKPOINT_SHARE = 0.5


def auto_checkpoint_lines(per_line: int, num_seqs: int, free_bytes: int | None,
                          total_bytes: int, utilization: float) -> int:  # fmt: skip
    """Prefix-cache checkpoint lines when none are given: ``num_seqs`` (one per sequence),
    or fewer where ``CHECKPOINT_SHARE`` of what the GPU has left (``free_bytes`` of
    ``total_bytes`` less the share ``utilization`` keeps back, less the null line and
    ``num_seqs`` lines of ``per_line`` bytes) holds fewer. ``free_bytes`` None (a CPU
    device, whose state pool is not sized from memory): ``num_seqs``."""
    if free_bytes is None:
        return num_seqs
    left = free_bytes - total_bytes * (1.0 - utilization) - (num_seqs + 1) * per_line
    return max(0, min(num_seqs, math.floor(CHECKPOINT_SHARE * left / per_line)))


def replay_len_for(model, config, device: torch.device) -> int:
    """The ring length L every Mamba spec of ``model`` gets (0: no replay). ``use_replayssm``
    True: ``replayssm_buffer_len`` (a Mamba1 layer's spec then refuses it); False: 0; not
    given: ``VLLM_USE_REPLAYSSM`` if set, else the device's measured default for the SSM
    state's dtype (``mamba_ssm_replay.default_on``), and never for a model with Mamba1 layers."""
    on = config.use_replayssm
    if on is None:
        on = default_on(device, config.ssm_state_dtype)
    if not on:
        return 0
    if config.replayssm_by_default:
        specs = model.get_cache_specs(config.block_size, config.ssm_state_dtype).values()
        if not all(s.replayable for s in specs if isinstance(s, MambaStateSpec)):
            logger.info("replayed decode off by default: this model has Mamba1 layers")
            return 0
    return config.replayssm_buffer_len


def checkpoint_lines_for(model, config, device: torch.device, replay: int = 0) -> int:
    """``config.num_checkpoint_lines``, or where it is None (caching on, no count given)
    ``auto_checkpoint_lines`` of the model's state line (its rings of ``replay`` L
    included, ``replay_len_for``), the least over the tensor-parallel ranks (each measures
    its own memory); ValueError when none fits."""
    lines = config.num_checkpoint_lines
    if lines is not None:
        return lines
    specs = model.get_cache_specs(config.block_size, config.ssm_state_dtype).values()
    per_line = line_bytes(
        replace(s, replay_len=replay) for s in specs if isinstance(s, MambaStateSpec)
    )
    if per_line == 0:
        return 0  # no Mamba state to checkpoint
    free, total = None, 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
    lines = auto_checkpoint_lines(
        per_line, config.max_num_seqs, free, total, config.gpu_memory_utilization
    )
    lines = min_over_ranks(lines)  # every rank holds the lines the engine core indexes
    if lines >= 1:
        return lines
    if config.enable_prefix_caching is None:  # the default: off, and said
        logger.info(
            "prefix caching off: no checkpoint line of %.1f MiB fits in half of the GPU "
            "memory left after %d sequence lines (give --num-checkpoint-lines to insist)",
            per_line / 2**20,
            config.max_num_seqs,
        )
        return 0
    raise ValueError(
        f"enable_prefix_caching: no prefix-cache checkpoint line of {per_line / 2**20:.1f} "
        f"MiB fits in half of the GPU memory left after the weights and "
        f"{config.max_num_seqs} sequence lines (max_num_seqs) within "
        f"gpu_memory_utilization={config.gpu_memory_utilization}: lower --max-num-seqs, "
        "give --num-checkpoint-lines, or turn prefix caching off"
    )


class CacheEngine:
    def __init__(
        self,
        model,
        *,
        num_slots: int,
        block_size: int,
        ssm_dtype: torch.dtype,
        device: torch.device,
        replayssm_buffer_len: int = 0,
        num_checkpoint_lines: int = 0,
    ):
        self.model = model
        self.block_size = block_size
        self.device = device
        specs = model.get_cache_specs(block_size, ssm_dtype)
        self.mamba_specs = {
            n: replace(s, replay_len=replayssm_buffer_len)
            for n, s in specs.items()
            if isinstance(s, MambaStateSpec)
        }
        self.attn_specs = {n: s for n, s in specs.items() if isinstance(s, AttentionSpec)}
        unknown = set(specs) - set(self.mamba_specs) - set(self.attn_specs)
        if unknown:
            raise ValueError(f"cache specs of an unknown kind for layers {sorted(unknown)}")
        for name, spec in self.attn_specs.items():
            if spec.block_size != block_size:
                raise ValueError(f"layer {name} asks for blocks of {spec.block_size} tokens")
        self.mamba_pool: MambaStatePool | None = None
        if self.mamba_specs and device.type == "cuda":
            torch.cuda.empty_cache()  # what the allocator caches but does not use is free
            check_pool_fits(
                list(self.mamba_specs.values()),
                num_slots,
                num_checkpoint_lines,
                torch.cuda.mem_get_info(device)[0],
                device,
            )
        if self.mamba_specs:
            self.mamba_pool = MambaStatePool.from_specs(
                list(self.mamba_specs.values()), num_slots, model.conv_backend, device
            )
            bind_state_pool(model, self.mamba_pool, list(self.mamba_specs))
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.num_blocks = 0

    @property
    def has_attention(self) -> bool:
        return bool(self.attn_specs)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block, over every attention layer."""
        return sum(spec.bytes_per_block for spec in self.attn_specs.values())

    def kv_nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_kv(self, num_blocks: int) -> None:
        """(Re)allocate every attention layer's KV cache with ``num_blocks`` blocks and bind
        it to the layer (the old tensors are dropped first, so their memory is reused)."""
        if not self.has_attention:
            return
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        bind_kv_cache(self.model, dict.fromkeys(self.kv_caches))
        self.kv_caches = {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        for name, spec in self.attn_specs.items():
            shape = (num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size)
            cache = torch.zeros(shape, dtype=spec.dtype, device=self.device).transpose(0, 1)
            self.kv_caches[name] = cache
        bind_kv_cache(self.model, self.kv_caches)
        self.num_blocks = num_blocks

    def num_kv_blocks(
        self,
        *,
        override: int | None,
        gpu_memory_utilization: float,
        max_num_seqs: int,
        max_model_len: int,
        peak_activation_bytes: int = 0,
    ) -> int:
        """The KV cache's block count (see ``EngineConfig``); ValueError when it cannot hold
        one sequence of ``max_model_len`` tokens."""
        need = self.blocks_for(max_model_len)
        if override is not None:
            num = override
            source = f"num_gpu_blocks_override={override}"
        elif self.device.type == "cuda":
            # Each rank measures its own memory; the ranks' caches must be the same size.
            num = min_over_ranks(
                self._blocks_from_gpu_memory(gpu_memory_utilization, peak_activation_bytes)
            )
            source = f"gpu_memory_utilization={gpu_memory_utilization}"
        else:
            cap = max(CPU_KV_CACHE_BYTES // self.bytes_per_block, need)
            num = min(max_num_seqs * need, cap)
            source = "the CPU default"
        if num < need:
            raise ValueError(
                f"the KV cache from {source} has {num} blocks of {self.block_size} tokens "
                f"({num * self.block_size} tokens), fewer than one sequence of max_model_len="
                f"{max_model_len} needs ({need} blocks): lower max_model_len, or give the KV "
                "cache more memory (gpu_memory_utilization, num_gpu_blocks_override)"
            )
        return num

    def _blocks_from_gpu_memory(self, utilization: float, peak_activation_bytes: int) -> int:
        """Blocks that fit in ``utilization`` of the GPU's memory next to what is there now
        (weights, state pool, other processes' memory), the activations' peak, and the
        KV cache allocated for start-up (dropped before the sized one is made)."""
        torch.cuda.empty_cache()  # what the allocator caches but does not use is free
        free, total = torch.cuda.mem_get_info(self.device)
        in_use = total - free - self.kv_nbytes()
        budget = total * utilization - in_use - peak_activation_bytes
        return max(0, math.floor(budget / self.bytes_per_block))
