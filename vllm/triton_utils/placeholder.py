"""Stand-ins for ``triton`` and ``triton.language`` on machines without Triton.

They let a kernel module be imported, not run: ``@triton.jit`` (bare or called with
options), ``@triton.autotune(...)``, ``@triton.heuristics(...)``, ``triton.Config(...)``
and annotations such as ``N: tl.constexpr`` all work at definition time, and
``triton.cdiv``/``triton.next_power_of_2`` compute as Triton's do. Launching a kernel,
``_kernel[grid](...)`` or ``_kernel(...)``, raises RuntimeError.
"""

import functools
from collections.abc import Callable
from typing import Any

_NOT_INSTALLED = "Triton is not installed: {} cannot run. Install triton (see requirements/)."


class _LanguagePlaceholder:
    """``tl`` and everything reached from it: any attribute or call gives another one.

    Only definition-time code touches it (annotations, defaults, dtype constants);
    kernel bodies never run without Triton.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_LanguagePlaceholder":
        if attr.startswith("_"):
            # Leave the protocols (copy, pickle, inspect) their usual answers.
            raise AttributeError(attr)
        child = _LanguagePlaceholder(f"{self._name}.{attr}")
        # Kept, so that `tl.float16 is tl.float16` holds as it does with Triton.
        setattr(self, attr, child)
        return child

    def __call__(self, *args: Any, **kwargs: Any) -> "_LanguagePlaceholder":
        return _LanguagePlaceholder(f"{self._name}(...)")

    def __repr__(self) -> str:
        return f"<placeholder {self._name}: Triton is not installed>"


class _PlaceholderKernel:
    """What ``@triton.jit`` makes of a function without Triton: importable, not runnable."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(_NOT_INSTALLED.format(f"kernel {self.fn.__qualname__}"))

    __call__ = _refuse

    def __getitem__(self, grid: Any) -> Callable:
        return self._refuse


def _decorator(wrap: Callable[[Callable], Any]) -> Callable:
    """A decorator usable bare (``@d``) or with options (``@d(...)``); options are ignored."""

    def decorate(*args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return wrap(args[0])
        return wrap

    return decorate


def _unchanged(fn: Callable) -> Callable:
    return fn


def _cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


def _next_power_of_2(n: int) -> int:
    # Triton's answer for 0 is 0.
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


class _Config:
    """Holds what ``triton.Config`` was given; nothing reads it without Triton."""

    def __init__(self, kwargs: dict, **options: Any) -> None:
        self.kwargs = kwargs
        self.options = options


class _TritonPlaceholder:
    """``triton`` without Triton. Names other than the ones below raise AttributeError."""

    language = _LanguagePlaceholder("tl")
    jit = staticmethod(_decorator(_PlaceholderKernel))
    autotune = staticmethod(_decorator(_unchanged))
    heuristics = staticmethod(_decorator(_unchanged))
    Config = _Config
    cdiv = staticmethod(_cdiv)
    next_power_of_2 = staticmethod(_next_power_of_2)

    def __getattr__(self, attr: str) -> Any:
        raise AttributeError(_NOT_INSTALLED.format(f"triton.{attr}"))

    def __repr__(self) -> str:
        return "<placeholder triton: Triton is not installed>"


triton = _TritonPlaceholder()
tl = triton.language
