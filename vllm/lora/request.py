"""LoRARequest: vLLM's description of one adapter (name, integer id, path).

Clients import it to build requests (lm-eval does at import time, and builds one when it is
given ``lora_local_path``). The type exists so that they import and so that a request for an
adapter is refused clearly: this package has no LoRA support, and ``LLM.generate`` raises
a ``ValueError`` for any ``lora_request`` that is not None rather than quietly running the
base model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name``: a name for the adapter; ``lora_int_id``: its id, >= 1 (vLLM reserves
    0 for "no adapter"); ``lora_path``: where its weights are."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")

    # vLLM's accessors.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
