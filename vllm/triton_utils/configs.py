"""Launch configurations as data: per-device JSON tables beside the kernels.

An op keeps its tables in ``<its ops folder>/configs/<op>/``: one file per device,
named as ``device_file_name`` spells the GPU (``NVIDIA_H200.json``), and ``default.json``
for every device without its own (and for the interpreter). The ``tune_*`` scripts under
``benchmarks/kernels/`` write them with ``write_table``. A file holds::

    {"meta": {"command": ..., "commit": ..., "device": ..., ...},   # how it was made
     "entries": {"<key>": {"BLOCK_T": 64, ..., "num_warps": 4, "num_stages": 1}, ...}}

Keys are strings the op builds from what its choice depends on (``table_key``), e.g.
``"dstate=128,dtype=bfloat16,headdim=64"``. The op reads an entry with ``lookup``, which
falls back from the device's file to ``default.json`` key by key, then to ``"*"``.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import torch

DEFAULT = "default"
WILDCARD = "*"


def device_file_name(device: torch.device | int | None = None) -> str:
    """The table file stem for a device: its CUDA name with spaces and odd characters as
    '_' (``NVIDIA_H200``); ``default`` without CUDA."""
    if not torch.cuda.is_available():
        return DEFAULT
    name = torch.cuda.get_device_name(device)
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)


def table_key(**parts) -> str:
    """``k1=v1,k2=v2`` over the sorted names; dtypes as their short names."""

    def text(v) -> str:
        return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else str(v)

    return ",".join(f"{k}={text(v)}" for k, v in sorted(parts.items()))


@functools.cache
def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open() as f:
        data = json.load(f)
    entries = data.get("entries")
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: a launch table needs an 'entries' object")
    return entries


def lookup(folder: Path, key: str, device: torch.device | int | None = None) -> dict:
    """The entry for ``key``: the device's table, then ``default.json``, each at the key and
    then at ``"*"``. A copy (callers may add to it). KeyError naming the folder and key
    when no table has it: every op ships a default that covers its keys."""
    names = [device_file_name(device), DEFAULT] if torch.cuda.is_available() else [DEFAULT]
    for stem in names:
        entries = _read(Path(folder) / f"{stem}.json")
        for k in (key, WILDCARD):
            if k in entries:
                return dict(entries[k])
    raise KeyError(f"no launch configuration for {key!r} in {folder} (tables: {names})")


def lookup_first(folder: Path, keys: list[str], device: torch.device | int | None = None) -> dict:
    """``lookup`` over several keys, most specific first: the first key found in the
    device's table or in ``default.json`` wins (a tuned shape over a general one); ``"*"``
    only when none is. A copy, as ``lookup``'s."""
    names = [device_file_name(device), DEFAULT] if torch.cuda.is_available() else [DEFAULT]
    for k in (*keys, WILDCARD):
        for stem in names:
            entries = _read(Path(folder) / f"{stem}.json")
            if k in entries:
                return copy.deepcopy(entries[k])
    raise KeyError(f"no launch configuration for {keys!r} in {folder} (tables: {names})")


def write_table(path: Path, entries: dict[str, dict], meta: dict) -> None:
    """Write a table (sorted keys, one entry per line block) and forget cached reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"meta": meta, "entries": entries}, indent=1, sort_keys=True)
    path.write_text(text + "\n")
    _read.cache_clear()
