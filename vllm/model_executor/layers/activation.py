"""The MLP activations the hybrid models name in their configs, by transformers' names.

``get_act_fn(name)``: "silu"/"swish", "gelu" (exact, erf), "gelu_pytorch_tanh"/"gelu_new"
(tanh approximation), "relu2" (squared ReLU, NemotronH's). Each maps a tensor to one of
its dtype, as transformers' ``ACT2FN`` entries of the same names do.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "relu2": relu2,
}


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"activation {name!r} is not supported; use one of {', '.join(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[name]
