"""The house's floors: imports point down. The engine (plain data and decisions) never
imports the worker (the device work), nor the worker or the executor the engine; the types
they exchange (``vllm/step_io.py``) import nothing of the package. Checked twice: every
import statement in the source (a function's own included), and what importing the worker
side actually loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm"

# (the files, the modules they must not import)
RULES = [
    ("worker", ["vllm.engine", "vllm.entrypoints"]),
    ("executor", ["vllm.engine", "vllm.entrypoints"]),
    ("engine", ["vllm.worker", "vllm.entrypoints"]),
]


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement of ``path`` names (absolute, as written)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def offending(modules: set[str], banned: list[str]) -> list[str]:
    return sorted(m for m in modules for b in banned if m == b or m.startswith(b + "."))


@pytest.mark.parametrize("floor, banned", RULES, ids=[r[0] for r in RULES])
def test_no_import_points_up(floor, banned):
    files = sorted((PACKAGE / floor).rglob("*.py"))
    assert files, f"no source under vllm/{floor}"
    bad = {
        str(f.relative_to(ROOT)): hits
        for f in files
        if (hits := offending(imported_modules(f), banned))
    }
    assert not bad, bad


def test_step_io_imports_nothing_of_the_package():
    modules = imported_modules(PACKAGE / "step_io.py")
    assert not offending(modules, ["vllm"]), modules


def test_the_worker_side_loads_no_engine_module():
    code = (
        "import sys, vllm.worker.worker, vllm.executor.uniproc, vllm.executor.multiproc; "
        "print(sorted(m for m in sys.modules if m.startswith(('vllm.engine', "
        "'vllm.entrypoints'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_the_rules_catch_an_upward_import(tmp_path):
    """The checker itself: an upward import, at the top or inside a function, is found."""
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from vllm.engine.core import EngineCore\n")
    assert offending(imported_modules(src), ["vllm.engine"]) == [
        "vllm.engine.core",
        "vllm.engine.core.EngineCore",
    ]
    src.write_text("import vllm.engines_elsewhere\nfrom vllm import engine\n")
    assert offending(imported_modules(src), ["vllm.engine"]) == ["vllm.engine"]
