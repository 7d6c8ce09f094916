"""EngineConfig: every knob of the engine, checked once."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from vllm import envs
from vllm.compilation_config import CUDAGRAPH_MODES, CompilationConfig  # noqa: F401
from vllm.executor.tp_checks import check_tp_divisibility
from vllm.logger import init_logger
from vllm.model_executor.model_loader.loader import LOAD_FORMATS, check_tensor_parallel_support
from vllm.model_executor.model_loader.weight_utils import check_safetensors_files
from vllm.model_executor.models.registry import is_model_config, load_model_config, model_class
from vllm.transformers_utils.hub import resolve_model, resolve_tokenizer

logger = init_logger(__name__)

# --mamba-cache-mode (upstream's name): which prompt checkpoints are written under prefix
# caching (docs/prefix_caching.md, "Where checkpoints are written").
MAMBA_CACHE_MODES = ("none", "align", "all")
_SSM_CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def check_mixed_step_ratio(ratio) -> float:
    """``max_mixed_step_ratio`` as a float, or ValueError naming the field: 0 (off) or
    >= 1 (1: a mixed step as long as a decode step: every cut at its floor)."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or ratio != ratio:
        raise ValueError(f"max_mixed_step_ratio must be a number, got {ratio!r}")
    if ratio != 0 and not 1 <= ratio < float("inf"):
        raise ValueError(
            f"max_mixed_step_ratio must be 0 (off) or a finite number >= 1 (a step with "
            f"prompt tokens beside decodes takes at most that many times a decode-only "
            f"step), got {ratio!r}"
        )
    return float(ratio)


@dataclass
class EngineConfig:
    """``model`` is an HF model directory of a registered architecture
    (``vllm/model_executor/models/registry.py``) or a registered config such as
    ``Mamba2ModelConfig`` (dummy weights).

    ``max_num_seqs`` is both the most sequences in a step and the number of state slots: a
    running sequence always owns a slot, so admission never needs preemption.
    ``max_num_batched_tokens`` is the token budget of one step (decodes + prefill chunks); it
    must cover a decode token of every running sequence. ``long_prefill_token_threshold``
    (vLLM's name) N > 0 caps the tokens one sequence computes in a step at N: a longer
    prompt is prefilled in chunks of at most N over several steps, so a step beside running
    decodes carries at most N tokens of each prompt (0, the default: only the step budget
    cuts chunks). The budget still bounds the step's total: several prompts may each bring
    N. An N >= ``max_num_batched_tokens`` never binds (the budget cuts first) and is
    accepted with a warning, as vLLM accepts it. ``max_mixed_step_ratio`` R >= 1 cuts each
    prompt's chunk beside D decodes so that the step takes about R times a decode-only
    step of D decodes, from the steps' measured times (``engine/step_budget.py``; 0: off).
    ``mamba_ssm_cache_dtype`` (vLLM's name) is the dtype of the SSM state pool: "float32"
    (default), "bfloat16" or "float16"; the scan and the decode update compute in fp32
    whatever it is, and read and write the pool in it. ``async_scheduling`` dispatches
    each step before the host reads the previous step's tokens (``llm_engine.py``);
    ``late_dispatch`` (None, the default: on with async scheduling; True needs it) has the
    serving loop wait for new requests until just before the device ends its step
    (``engine/late_dispatch.py``).
    ``max_model_len`` bounds prompt + output tokens (a longer prompt is refused, and
    generation stops there with finish reason "length"); None takes the config's
    ``max_position_embeddings``, else 2048 (vLLM's fallback). ``served_model_name`` is the
    name the server answers to (default: the model argument).

    ``compilation_config`` (vLLM's: a dict, its JSON or a ``CompilationConfig``) sets
    ``cudagraph_mode``: "NONE", "FULL_DECODE_ONLY" (decode-only steps replay CUDA graphs) or
    "FULL" (the default: decode-only AND mixed prefill + decode steps replay CUDA graphs
    captured at start-up for buckets of padded token count and sequence count; a step outside
    them runs eagerly, counted by the ``execution`` label of ``vllm:engine_step_seconds``).
    ``enforce_eager`` means "NONE" and wins, with a warning (property ``cudagraph_mode``: the
    mode in effect). No graphs off CUDA. ``max_cudagraph_capture_size`` (upstream's key)
    caps the tokens of a graphed step (default 2048: larger steps take longer on the device
    than the host takes to issue them eagerly).

    ``model`` and ``tokenizer`` (default: the model's) are each a directory or a Hugging
    Face Hub id (``ORG/NAME``), resolved once here to ``model_dir`` / ``tokenizer_dir``
    (``vllm/transformers_utils/hub.py``: the cache, or a download of ``revision`` /
    ``tokenizer_revision`` into ``download_dir``, default huggingface_hub's cache); the
    engine reads only those, and ``model`` stays what was given (the served name). Unless
    ``load_format`` is "dummy" every safetensors file is opened here, so a missing or
    truncated one fails before any process starts. ``device`` is "auto" (CUDA when
    there is a GPU, else CPU), "cuda", "cuda:N" or "cpu"; CUDA must be there.

    The KV cache of models with attention layers (Bamba, NemotronH, Zamba2) is paged in
    blocks of ``block_size`` tokens. The block count is ``num_gpu_blocks_override`` when
    set; else on CUDA what ``gpu_memory_utilization`` (the fraction of the GPU's memory the
    engine may use in all) leaves after the weights, the state pool and the activations
    of a full step; else (CPU) enough for ``max_num_seqs`` sequences of ``max_model_len``
    tokens, at most 4 GiB. It must hold one sequence of ``max_model_len`` tokens. Models
    without attention layers (pure Mamba2) have no KV cache: the three are then unused.

    ``use_replayssm`` (upstream's name) runs the Mamba2 layers' decode rows through the
    replayed update (``ops/mamba_ssm_replay``, docs/replayssm.md): each state slot keeps a
    ring of its last ``replayssm_buffer_len`` - 1 decode steps' inputs, so a slot's state is
    read every step but written every ``replayssm_buffer_len``-th (default 16, from 2 to
    128); the rings are part of the state pool (counted in its memory and so in what
    ``gpu_memory_utilization`` leaves for the KV cache). None (the default): the workers take
    ``VLLM_USE_REPLAYSSM`` (vllm/envs.py), else the GPU's measured default (ops/configs/
    replayssm/engine_default.json: on for the H100, off elsewhere), never for Mamba1 layers.

    ``enable_prefix_caching`` (vLLM's flag; None, the default: on, as upstream's, where a
    checkpoint line fits; for a hybrid a hit also shares the attention KV blocks,
    ``vllm/engine/kv_prefix.py``) keeps the state of every request that finishes (stop or
    length) in one of ``num_checkpoint_lines`` extra state-pool lines (None: the worker's
    ``cache_engine.auto_checkpoint_lines``, ``max_num_seqs`` or fewer on a GPU where they would
    take over half what is left), keyed by the hash chain of its tokens in blocks of
    ``mamba_block_size``; a later prompt that extends it restores the state and prefills only
    the rest (docs/prefix_caching.md). ``mamba_cache_mode`` (upstream's ``--mamba-cache-mode``)
    adds prompt checkpoints on the block grid: ``align`` (default) at the end of prefill chunks
    the budget cuts anyway, rounded down to the grid, and, with
    ``enable_mamba_shared_prefix_checkpoint`` (default True), at the deepest block boundary a
    former prompt shared; ``all`` at every boundary (one step per block); ``none`` caches no
    Mamba state at all. Align's chunk-end checkpoints are only written for a prompt whose first
    block an earlier prompt had, unless ``enable_mamba_align_cold_checkpoint`` (default False):
    a prompt nobody sent before rarely repays a whole state line's copy.
    ``enable_mamba_prompt_end_checkpoint`` (default False) also checkpoints each prompt's end,
    for chat turns whose history does not hold the ids generated.

    ``tensor_parallel_size`` N > 1 shards the model over N processes (one per GPU, or CPU
    processes under gloo with ``device="cpu"``): checked here, before any process starts,
    against the model's heads and groups (``check_tp_divisibility``) and refused for a
    model class that does not shard (``check_tensor_parallel_support``; every registered
    model shards, the hybrids included).
    """

    model: str | os.PathLike | Any
    tokenizer: str | os.PathLike | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | os.PathLike | None = None
    load_format: str = "auto"
    dtype: str | None = None
    device: str = "auto"
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enforce_eager: bool = False
    mamba_ssm_cache_dtype: str = "float32"
    async_scheduling: bool = True
    late_dispatch: bool | None = None
    max_model_len: int | None = None
    served_model_name: str | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    tensor_parallel_size: int = 1
    long_prefill_token_threshold: int = 0
    max_mixed_step_ratio: float = 0.0
    use_replayssm: bool | None = None
    replayssm_buffer_len: int = 16
    enable_prefix_caching: bool | None = None
    mamba_block_size: int = 64
    num_checkpoint_lines: int | None = None
    mamba_cache_mode: str = "align"
    enable_mamba_shared_prefix_checkpoint: bool = True
    enable_mamba_prompt_end_checkpoint: bool = False
    enable_mamba_align_cold_checkpoint: bool = False
    compilation_config: CompilationConfig | dict | str | None = None
    # Set from the fields above: the model's and tokenizer's files; use_replayssm not given.
    model_dir: Any = field(init=False, default=None, repr=False)
    tokenizer_dir: Any = field(init=False, default=None, repr=False)
    replayssm_by_default: bool = field(init=False, default=False, repr=False)

    def __post_init__(self):
        model = self.model
        if not (
            isinstance(model, os.PathLike) or (isinstance(model, str) and model)
        ) and not is_model_config(model):
            raise ValueError(
                f"model must be a model directory, a Hugging Face Hub id (ORG/NAME) or a "
                f"registered model config such as Mamba2ModelConfig, got {model!r}"
            )
        if isinstance(self.mamba_ssm_cache_dtype, torch.dtype):
            self.mamba_ssm_cache_dtype = str(self.mamba_ssm_cache_dtype).removeprefix("torch.")
        if self.mamba_ssm_cache_dtype not in _SSM_CACHE_DTYPES:
            raise ValueError(
                f"mamba_ssm_cache_dtype must be one of {', '.join(_SSM_CACHE_DTYPES)}, got "
                f"{self.mamba_ssm_cache_dtype!r}"
            )
        ints = ("max_num_seqs", "max_num_batched_tokens", "seed", "block_size",
                "tensor_parallel_size", "long_prefill_token_threshold")  # fmt: skip
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        length = self.replayssm_buffer_len
        if isinstance(length, bool) or not isinstance(length, int) or not 2 <= length <= 128:
            raise ValueError(
                f"replayssm_buffer_len (--replayssm-buffer-len) must be an integer from 2 to "
                f"128 (the steps between two state writes; the ring's counters are int8), "
                f"got {length!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        override = self.num_gpu_blocks_override
        if override is not None and (
            isinstance(override, bool) or not isinstance(override, int) or override < 1
        ):
            raise ValueError(
                f"num_gpu_blocks_override must be a positive integer or None, got {override!r}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence decodes each step"
            )
        if self.late_dispatch is None:
            self.late_dispatch = self.async_scheduling
        if self.late_dispatch and not self.async_scheduling:
            raise ValueError(
                "late_dispatch (--late-dispatch) needs async scheduling: without it every "
                "step is read before the next is scheduled, so there is no step to wait beside"
            )
        threshold = self.long_prefill_token_threshold
        if threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: off), got {threshold}")
        if threshold >= self.max_num_batched_tokens:
            logger.warning(
                "long_prefill_token_threshold (%d) >= max_num_batched_tokens (%d): the step "
                "budget cuts prefill chunks first, so the threshold has no effect",
                threshold,
                self.max_num_batched_tokens,
            )
        self.max_mixed_step_ratio = check_mixed_step_ratio(self.max_mixed_step_ratio)
        self.device = _check_device(self.device)
        self.compilation_config = CompilationConfig.from_any(self.compilation_config)
        asked = self.compilation_config.cudagraph_mode
        if self.enforce_eager and asked not in (None, "NONE"):
            logger.warning(
                "enforce_eager wins over compilation_config: cudagraph_mode %s ignored, NONE "
                "used (no CUDA graphs)", asked,
            )  # fmt: skip
        if self.use_replayssm is None:  # the variable's, else the device's (cache_engine.py)
            self.use_replayssm, self.replayssm_by_default = envs.VLLM_USE_REPLAYSSM, True
        if self.use_replayssm is not None and not isinstance(self.use_replayssm, bool):
            raise ValueError(f"use_replayssm must be True or False, got {self.use_replayssm!r}")
        self._check_prefix_caching()
        # After the checks above: resolving may download the model.
        self._resolve_model()
        if self.max_model_len is None:
            self.max_model_len = self.model_config.max_position_embeddings or 2048
        if (
            isinstance(self.max_model_len, bool)
            or not isinstance(self.max_model_len, int)
            or self.max_model_len < 1
        ):
            raise ValueError(
                f"max_model_len must be a positive integer, got {self.max_model_len!r}"
            )
        rope_positions = getattr(self.model_config, "rope_positions", None)
        if rope_positions is not None and self.max_model_len > rope_positions:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the {rope_positions} positions "
                "the model's rotary embedding covers (max_position_embeddings in its config)"
            )
        if self.tensor_parallel_size > 1:
            check_tensor_parallel_support(model_class(self.model_config), self.tensor_parallel_size)
            check_tp_divisibility(self.model_config, self.tensor_parallel_size)
        if self.served_model_name is None:
            self.served_model_name = (
                self.model.model_type if is_model_config(self.model) else str(self.model)
            )

    def _check_prefix_caching(self) -> None:
        """Prefix caching (docs/prefix_caching.md): ``num_checkpoint_lines`` extra state-pool
        lines (0 when off; None: the worker sizes them) hold checkpoints by block hash."""
        if not isinstance(self.enable_prefix_caching, bool | None):
            raise ValueError(
                f"enable_prefix_caching must be True, False or None (the default: on where "
                f"it fits), got {self.enable_prefix_caching!r}"
            )
        size = self.mamba_block_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mamba_block_size must be an integer >= 1, got {size!r}")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"mamba_cache_mode (--mamba-cache-mode) must be one of "
                f"{', '.join(MAMBA_CACHE_MODES)}, got {self.mamba_cache_mode!r}"
            )
        for name in (
            "enable_mamba_shared_prefix_checkpoint",
            "enable_mamba_prompt_end_checkpoint",
            "enable_mamba_align_cold_checkpoint",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        lines = self.num_checkpoint_lines
        if self.enable_prefix_caching is False or self.mamba_cache_mode == "none":
            self.num_checkpoint_lines = 0
            return
        if lines is None:
            return  # the worker sizes it (cache_engine.checkpoint_lines_for)
        if isinstance(lines, bool) or not isinstance(lines, int) or lines < 1:
            raise ValueError(f"num_checkpoint_lines must be an integer >= 1, got {lines!r}")

    def _resolve_model(self) -> None:
        model = self.model
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        if is_model_config(model):
            if self.revision is not None:
                raise ValueError(
                    f"revision={self.revision!r} picks a snapshot of a Hugging Face Hub id, "
                    "but the model is a config object: drop the revision"
                )
            self.model_dir = model
        else:
            self.model_dir = resolve_model(
                model,
                revision=self.revision,
                download_dir=self.download_dir,
                load_format=self.load_format,
            )
            if self.load_format != "dummy":
                check_safetensors_files(self.model_dir)
        if self.tokenizer is None and is_model_config(model):
            return
        tokenizer = model if self.tokenizer is None else self.tokenizer
        revision = self.tokenizer_revision
        if revision is None and tokenizer == model:
            revision = self.revision  # vLLM's default: the model's own revision
        if tokenizer == model and revision == self.revision:
            self.tokenizer_dir = self.model_dir
        else:
            self.tokenizer_dir = resolve_tokenizer(
                tokenizer, revision=revision, download_dir=self.download_dir
            )
        self.tokenizer = tokenizer

    @cached_property
    def model_config(self):
        """The registered config of the model (``Mamba2ModelConfig``, ``BambaModelConfig``,
        ...), read from its config.json once."""
        return load_model_config(self.model_dir)

    @property
    def cudagraph_mode(self) -> str:
        """NONE under ``enforce_eager``, else the mode asked for, else FULL (a model or option
        that cannot take mixed-step graphs falls back to FULL_DECODE_ONLY at start-up)."""
        if self.enforce_eager:
            return "NONE"
        return self.compilation_config.cudagraph_mode or "FULL"

    @property
    def ssm_state_dtype(self) -> torch.dtype:
        return _SSM_CACHE_DTYPES[self.mamba_ssm_cache_dtype]


_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def _check_device(device) -> str:
    """The device to run on: "auto" picks CUDA or the CPU; any other value is checked
    against what this machine has."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise ValueError(
            f"device={device!r} is not supported: give 'auto' (CUDA when there is a GPU, "
            "else CPU), 'cuda', 'cuda:N' or 'cpu'"
        )
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            cpu_build = torch.version.cuda is None
            why = "this torch is a CPU-only build" if cpu_build else "torch sees no GPU"
            raise ValueError(
                f"device={device!r}, but no CUDA device is available ({why}): use "
                "device='cpu' (--device cpu), or 'auto' to take a GPU when there is one"
            )
        index, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
        if index >= count:
            raise ValueError(
                f"device={device!r}, but this machine has {count} CUDA device(s): give "
                f"cuda:0 .. cuda:{count - 1}"
            )
    return device
