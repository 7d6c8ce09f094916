"""vLLM's ``compilation_config`` (``--compilation-config`` / ``-cc``, ``LLM(compilation_config=
...)``): the keys this engine reads, checked once; ``EngineConfig`` holds one."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL")  # upstream's names

# Mixed steps above this many tokens run eagerly by default: on the H200 the host issues an
# eager 64-layer step in 30-46 ms, while a 7B step of ~1,300-2,000 tokens takes as long on
# the device, so a graph of a larger step saves no time and its padding costs some.
DEFAULT_MAX_CAPTURE_SIZE = 2048


@dataclass
class CompilationConfig:
    """``cudagraph_mode``: one of ``CUDAGRAPH_MODES`` (any case, stored upper-case); None:
    the default. ``max_cudagraph_capture_size`` (upstream's name): the most tokens a step
    replayed from a CUDA graph has (a decode batch has one per sequence); larger steps run
    eagerly. None: ``DEFAULT_MAX_CAPTURE_SIZE``."""

    cudagraph_mode: str | None = None
    max_cudagraph_capture_size: int | None = None

    def __post_init__(self):
        mode = self.cudagraph_mode
        if mode is not None and (not isinstance(mode, str) or mode.upper() not in CUDAGRAPH_MODES):
            raise ValueError(
                f"compilation_config cudagraph_mode {mode!r} is not supported: give one of "
                f"{', '.join(CUDAGRAPH_MODES)}"
            )
        self.cudagraph_mode = None if mode is None else mode.upper()
        size = self.max_cudagraph_capture_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(
                f"compilation_config max_cudagraph_capture_size must be a positive integer, "
                f"got {size!r}"
            )

    @property
    def capture_size(self) -> int:
        """The most tokens of a graphed step."""
        return self.max_cudagraph_capture_size or DEFAULT_MAX_CAPTURE_SIZE

    @classmethod
    def from_any(cls, value) -> CompilationConfig:
        """None, a dict, a JSON string of one, or a ``CompilationConfig``, checked."""
        accepted = [f.name for f in fields(cls)]
        if isinstance(value, cls | None):
            return cls(**{name: getattr(value, name, None) for name in accepted})
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"compilation_config: bad JSON ({err}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"compilation_config must be a dict (or JSON object), got {value!r}")
        unknown = [repr(key) for key in value if key not in accepted]
        if unknown:
            raise ValueError(
                f"compilation_config key(s) {', '.join(unknown)} not supported; accepted: "
                f"{', '.join(accepted)}"
            )
        return cls(**value)
