"""Exception kinds every floor shares (imports nothing of vllm).

``USER_ERRORS``: what a user's mistake raises (a model that is not there, weights missing
or truncated, an option out of range: ValueError, or OSError such as FileNotFoundError),
with a message that names the thing and the fix. The command line prints such an error as
one line (``entrypoints/cli/startup.py``); the engine process sends it to its parent as it
is (``engine/core_proc.py``). Anything else is a bug and keeps its traceback.
"""

USER_ERRORS = (ValueError, OSError)
