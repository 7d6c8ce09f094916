"""A Hugging Face cache folder, laid out as huggingface_hub writes it, filled from local files.

    commit = add_snapshot(cache, "org/tiny", model_dir)                 # refs/main -> commit
    add_snapshot(cache, "org/tiny", other_dir, ref="v2")                # a second snapshot
    add_snapshot(cache, "org/cfg", model_dir, files=["config.json"])    # some files only

Each repo is ``<cache>/models--ORG--NAME/`` with ``blobs/<sha256>`` (the file contents),
``snapshots/<commit>/<file>`` (relative symlinks to the blobs) and ``refs/<ref>`` (the
commit hash, no newline), which is what ``snapshot_download(..., local_files_only=True)``
and ``huggingface_hub.scan_cache_dir`` read. The commit is a hash of the files, so the
same files give the same commit.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def repo_folder(cache: str | os.PathLike, repo_id: str) -> Path:
    return Path(cache) / ("models--" + repo_id.replace("/", "--"))


def add_snapshot(
    cache: str | os.PathLike,
    repo_id: str,
    src: str | os.PathLike,
    *,
    files: list[str] | None = None,
    ref: str | None = "main",
) -> str:
    """Put ``files`` of ``src`` (default: every file in it) into a snapshot of ``repo_id``
    in ``cache``; point ``refs/<ref>`` at it (None: no ref, only its commit finds it).
    Returns the commit hash."""
    src = Path(src)
    names = sorted(files if files is not None else (p.name for p in src.iterdir() if p.is_file()))
    contents = {name: (src / name).read_bytes() for name in names}
    digest = hashlib.sha1()
    for name in names:
        digest.update(name.encode() + b"\0" + hashlib.sha256(contents[name]).digest())
    commit = digest.hexdigest()
    repo = repo_folder(cache, repo_id)
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in contents.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return commit
