"""How a command ends on a user's mistake: one line on stderr and exit status 1.

A model that is not there, a config.json that cannot be read, weights that are missing or
truncated, a Hub id not in the cache offline, an option out of range: these raise
ValueError or OSError (FileNotFoundError, ...) with a message that names the thing and the
fix, and a traceback would only bury that line. ``VLLM_LOGGING_LEVEL=DEBUG`` prints the
traceback as well. Any other exception is a bug and keeps Python's traceback.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any

from vllm.errors import USER_ERRORS


def run_or_exit(prog: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; a user error ends the process with ``"{prog}: error: message"``."""
    try:
        return fn(*args)
    except USER_ERRORS as err:
        if _debug():
            traceback.print_exception(err)
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(1)


def _debug() -> bool:
    from vllm import envs

    try:
        return envs.VLLM_LOGGING_LEVEL == "DEBUG"
    except ValueError:  # an unreadable level: the logger has refused it already
        return False
