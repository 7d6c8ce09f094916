"""run_info.git_sha: the commit a benchmark result names."""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchmarks.common.run_info import git_sha


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_a_tree_that_differs_from_head_is_named_modified(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_RUN_SHA", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    assert git_sha(repo) == head
    (repo / "new.txt").write_text("untracked files do not count\n")
    assert git_sha(repo) == head
    (repo / "a.py").write_text("x = 2\n")
    assert git_sha(repo) == f"{head}+modified"
    monkeypatch.setenv("VLLM_RUN_SHA", "abc1234")
    assert git_sha(repo) == "abc1234"


def test_outside_a_repository_it_says_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_RUN_SHA", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert git_sha(tmp_path) == "unknown"
