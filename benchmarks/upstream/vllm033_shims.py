"""Stand-ins for the few ``vllm.*`` names that upstream vLLM 0.33.0's extracted Triton
kernels import (benchmarks/upstream/extract_vllm033.py copies this file, as it is, to
``upstream_vllm033/shims.py`` and points their imports here; its ``SHIMS`` table says which
upstream name maps to which of these).

- ``current_platform``: a CUDA platform. With a GPU it reports the GPU's own capability and
  name; without one it reports sm_90 (capability (9, 0)) and "NVIDIA H200", so that
  upstream's platform-dependent choices made at import (its filter of the autotune configs
  Triton miscompiles on sm_90, the Blackwell checks) come out as they do on the H200 when
  the kernels are compiled for sm_90 on a machine without a GPU.
- ``tl``, ``triton``, ``HAS_TRITON``: Triton itself.
- ``envs``: the environment variables the kernels read, parsed as upstream parses them; any
  other name is an AttributeError that names it.
- ``init_logger``: a standard logger with upstream's ``*_once`` methods.
- ``NULL_BLOCK_ID`` / ``PAD_SLOT_ID``: upstream's values (0, -1).
- The fused-MoE utilities: swap-AB off (it is used for fp8 only), no tensor descriptors.
- ``Unavailable``: stands for upstream's compiled extensions (``_custom_ops``, XPU ops) and
  its CPU fallbacks, which are only reached on paths the benchmarks never take: any use
  raises, naming what was asked for.

Only the standard library, torch and Triton are imported: the extracted package does not
need this repository on the path.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, NamedTuple

import torch
import triton  # noqa: F401 - re-exported
import triton.language as tl  # noqa: F401 - re-exported

HAS_TRITON = True
NULL_BLOCK_ID = 0
PAD_SLOT_ID = -1
# What the platform reports where there is no GPU: the H200 the benchmarks run on.
NO_GPU_CAPABILITY = (9, 0)
NO_GPU_NAME = "NVIDIA H200"


class DeviceCapability(NamedTuple):
    major: int
    minor: int

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"

    def to_int(self) -> int:
        return self.major * 10 + self.minor


def _as_int(capability: tuple[int, int] | int) -> int:
    if isinstance(capability, tuple):
        return capability[0] * 10 + capability[1]
    return capability


class CudaPlatform:
    """The subset of upstream's platform interface that its kernels ask."""

    device_type = "cuda"
    device_name = "cuda"
    dispatch_key = "CUDA"

    @staticmethod
    def is_cuda() -> bool:
        return True

    @staticmethod
    def is_cuda_alike() -> bool:
        return True

    @staticmethod
    def is_rocm() -> bool:
        return False

    @staticmethod
    def is_xpu() -> bool:
        return False

    @staticmethod
    def is_cpu() -> bool:
        return False

    @staticmethod
    def is_tpu() -> bool:
        return False

    @staticmethod
    def get_device_capability(device_id: int = 0) -> DeviceCapability:
        if torch.cuda.is_available():
            return DeviceCapability(*torch.cuda.get_device_capability(device_id))
        return DeviceCapability(*NO_GPU_CAPABILITY)

    @classmethod
    def has_device_capability(cls, capability, device_id: int = 0) -> bool:
        return cls.get_device_capability(device_id).to_int() >= _as_int(capability)

    @classmethod
    def is_device_capability(cls, capability, device_id: int = 0) -> bool:
        return cls.get_device_capability(device_id).to_int() == _as_int(capability)

    @classmethod
    def is_device_capability_family(cls, capability: int, device_id: int = 0) -> bool:
        return cls.get_device_capability(device_id).to_int() // 10 == capability // 10

    @staticmethod
    def get_device_name(device_id: int = 0) -> str:
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(device_id)
        return NO_GPU_NAME


current_platform = CudaPlatform()


def get_device_name_as_file_name(device_id: int = 0) -> str:
    """The device's name with runs of blanks and slashes made underscores."""
    return re.sub(r"[\s/]+", "_", current_platform.get_device_name(device_id))


def next_power_of_2(n: int) -> int:
    return 1 if n < 1 else 1 << (n - 1).bit_length()


class _Envs:
    """Upstream's ``vllm.envs`` for the variables its kernels read."""

    @property
    def VLLM_TUNED_CONFIG_FOLDER(self) -> str | None:
        return os.environ.get("VLLM_TUNED_CONFIG_FOLDER")

    @property
    def VLLM_BATCH_INVARIANT(self) -> bool:
        return bool(int(os.environ.get("VLLM_BATCH_INVARIANT", "0")))

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the vllm 0.33.0 shims do not provide envs.{name}")


envs = _Envs()


class _OnceLogger(logging.LoggerAdapter):
    """A logger whose ``*_once`` calls log a given message and arguments only once."""

    def __init__(self, logger: logging.Logger):
        super().__init__(logger, {})
        self._seen: set = set()

    def _once(self, level: int, msg: str, *args, **kwargs) -> None:
        kwargs.pop("scope", None)
        key = (level, msg, tuple(map(str, args)))
        if key not in self._seen:
            self._seen.add(key)
            self.log(level, msg, *args, **kwargs)

    def debug_once(self, msg: str, *args, **kwargs) -> None:
        self._once(logging.DEBUG, msg, *args, **kwargs)

    def info_once(self, msg: str, *args, **kwargs) -> None:
        self._once(logging.INFO, msg, *args, **kwargs)

    def warning_once(self, msg: str, *args, **kwargs) -> None:
        self._once(logging.WARNING, msg, *args, **kwargs)


def init_logger(name: str) -> _OnceLogger:
    return _OnceLogger(logging.getLogger(name))


# The fused-MoE kernel's utilities: the pointer path, as on a default install.
def enable_swap_ab(block_m: int, block_n: int) -> bool:
    return False


def resolve_moe_use_td() -> bool:
    return False


def warn_if_moe_use_td_ineffective(*args, **kwargs) -> None:
    return None


def set_triton_allocator(device) -> None:
    raise NotImplementedError("the vllm 0.33.0 shims use no tensor descriptors")


class Unavailable:
    """A part of upstream (a compiled extension, a CPU fallback) that is not extracted."""

    def __init__(self, what: str):
        self._what = what

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(f"{self._what}.{name} is not part of the extracted kernels")

    def __call__(self, *args, **kwargs) -> Any:
        raise NotImplementedError(f"{self._what} is not part of the extracted kernels")


custom_ops = Unavailable("vllm._custom_ops")
xpu_ops = Unavailable("vllm._xpu_ops.xpu_ops")
cpu_mamba_ssm = Unavailable("vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm")
cpu_selective_state_update = Unavailable(f"{cpu_mamba_ssm._what}.selective_state_update")
