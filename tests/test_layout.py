"""The tree's layout rules: code is imported as packages, never loaded by path.

- No file of the package, the benchmarks, the examples or the tests edits the interpreter's
  module search path or loads a module from a file path (importlib's spec from a file
  location): the benchmarks are the ``benchmarks`` package, run as
  ``python -m benchmarks.<family>.<name>``.
- A test module never imports another test module: what two of them share lives in
  ``tests/utils.py``, a folder's ``utils.py`` (or another helper module not named
  ``test_*``), or a conftest fixture. The check reads every import statement and also the
  source text, so code that a test runs in a child process is covered too.
- ``vllm bench serve`` needs only the installed package: its benchmark is ``vllm.benchmarks``
  (a package setup.py ships), and it runs from a folder outside the repository with
  ``benchmarks/`` not importable.
- One model path at every TP size: no model (``vllm/model_executor/models/``) and no Mamba
  layer (``vllm/model_executor/layers/mamba/*.py``) branches on the world size; the
  parallel layers and the collectives reduce to the plain operation on one rank.
- No file is over 400 lines except kernel files: the ops packages
  (``vllm/model_executor/layers/**/ops/``) and ``csrc/``, and result data (JSON, CSV,
  images under ``docs/benchmarks/``).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.utils import REPO

CHECKED = ("vllm", "benchmarks", "examples", "tests")
# Split so that this file's own text does not match (it is checked too).
PATH_LOADING = re.compile(r"sys\.path\b|spec_from_" + r"file_location")
TEST_IMPORT_TEXT = re.compile(
    r"^\s*(from\s+tests(\.\w+)*\.test_\w+\s+import|import\s+tests(\.\w+)*\.test_\w+"
    r"|from\s+tests(\.\w+)*\s+import\s+(\(\s*)?test_\w+)",
    re.M,
)


def python_files(*folders: str) -> list[Path]:
    files = [p for folder in folders for p in sorted((REPO / folder).rglob("*.py"))]
    return [p for p in files if ".venv" not in p.parts]


# A comparison of a TP or world size with 1 or 2, or the group's is_distributed.
WORLD_SIZE_BRANCH = re.compile(r"(tp_size|world_size)\s*(>|==|!=|>=)\s*[12]\b|is_distributed")


def test_no_model_or_mamba_layer_branches_on_the_world_size():
    files = python_files("vllm/model_executor/models")
    files += sorted((REPO / "vllm/model_executor/layers/mamba").glob("*.py"))
    assert len(files) > 10
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if WORLD_SIZE_BRANCH.search(line)
    ]
    assert not found, "one path at every TP size (the collectives are no-ops on one rank):\n" + (
        "\n".join(found)
    )
    assert WORLD_SIZE_BRANCH.search("return x if self.tp_size > 1 else y")
    assert WORLD_SIZE_BRANCH.search("if get_tp_group().world_size == 1:")
    assert not WORLD_SIZE_BRANCH.search("if tp_size < 1: raise ValueError")


def test_python_files_are_found():
    files = python_files(*CHECKED)
    assert len(files) > 100 and any(p.name == "benchmark_throughput.py" for p in files)


def test_nothing_edits_the_search_path_or_loads_a_file_by_path():
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in python_files(*CHECKED)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PATH_LOADING.search(line)
    ]
    assert not found, "load modules as packages instead:\n" + "\n".join(found)


def imported_test_modules(path: Path) -> list[str]:
    """The test modules (``test_*``) that an import statement of ``path`` names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found += [n for n in names if n.split(".")[-1].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    found = []
    for path in python_files("tests"):
        where = path.relative_to(REPO)
        found += [f"{where}: imports {name}" for name in imported_test_modules(path)]
        found += [
            f"{where}: {m.group(0).strip()}" for m in TEST_IMPORT_TEXT.finditer(path.read_text())
        ]
    assert not found, "move what is shared to tests/utils.py or a helper module:\n" + "\n".join(
        sorted(set(found))
    )


def test_benchmark_modules_are_imported_through_their_package():
    """A bare ``import run_info`` works only with the script's folder on the search path."""
    stems = {p.stem for p in (REPO / "benchmarks").rglob("*.py") if p.stem != "__init__"}
    found = []
    for path in python_files(*CHECKED):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            found += [f"{where}: {n}" for n in names if n.split(".")[0] in stems]
    assert not found, "import them as benchmarks.<family>.<name>:\n" + "\n".join(found)


def test_the_checks_catch_what_they_forbid(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "from tests.engine." + "test_scheduler import make_seq\n"
        "from .test_other import x\n"
        "def f():\n    from tests.models import test_bamba\n"
        "CHILD = '''\nfrom tests.engine." + "test_cold_start import f\n'''\n"
    )
    assert imported_test_modules(bad) == [
        "tests.engine.test_scheduler",
        ".test_other",
        "tests.models.test_bamba",
    ]
    assert len(TEST_IMPORT_TEXT.findall(bad.read_text())) == 3
    assert PATH_LOADING.search("sys" + ".path.insert(0, here)")
    assert not TEST_IMPORT_TEXT.search("from tests.utils import REPO")


MAX_LINES = 400
SIZED = {".py", ".sh", ".md", ".toml", ".cfg", ".txt", ".yaml", ".yml", ".cmake"}
SKIPPED_DIRS = {".venv", ".whl", ".git", "build", "dist", "__pycache__", ".upstream", "out"}


def is_kernel_file(rel: Path) -> bool:
    parts = rel.parts
    return parts[0] == "csrc" or (
        parts[:3] == ("vllm", "model_executor", "layers") and "ops" in parts
    )


def sized_files() -> list[Path]:
    found = []
    for folder, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        for name in names:
            rel = (Path(folder) / name).relative_to(REPO)
            if rel.suffix in SIZED or name in ("CMakeLists.txt", "run"):
                found.append(rel)
    return sorted(found)


def test_no_file_over_400_lines_outside_kernel_files():
    files = sized_files()
    assert any(p.name == "gpu_check.sh" for p in files) and Path("README.md") in files
    found = []
    for rel in files:
        if is_kernel_file(rel):
            continue
        n = len((REPO / rel).read_text(errors="replace").splitlines())
        if n > MAX_LINES:
            found.append(f"{rel}: {n} lines")
    assert not found, (
        f"split these (at most {MAX_LINES} lines outside kernel files):\n" + "\n".join(found)
    )


def test_kernel_files_are_only_the_ops_and_csrc():
    assert is_kernel_file(Path("vllm/model_executor/layers/mamba/ops/causal_conv1d.py"))
    assert is_kernel_file(Path("csrc/mamba/causal_conv1d/causal_conv1d_kernels.cuh"))
    assert not is_kernel_file(Path("vllm/model_executor/layers/mamba/mamba_mixer2.py"))
    assert not is_kernel_file(Path("benchmarks/kernels/benchmark_ssd.py"))
    assert not is_kernel_file(Path("tests/kernels/mamba/test_causal_conv1d.py"))


def test_setup_ships_the_serving_benchmark():
    from setuptools import find_packages

    packages = find_packages(where=str(REPO), include=["vllm", "vllm.*"])
    assert "vllm.benchmarks" in packages
    assert not any(p.startswith(("benchmarks", "tests")) for p in packages)


def test_bench_serve_help_runs_outside_the_repository(tmp_path):
    """Only the vllm package on the path (a link to it in an empty folder, as an installed
    package sits in site-packages), run from that folder: `vllm bench serve --help`."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "vllm").symlink_to(REPO / "vllm", target_is_directory=True)
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('benchmarks') is None, 'benchmarks/ is importable'\n"
        "sys.argv = ['vllm', 'bench', 'serve', '--help']\n"
        "from vllm.entrypoints.cli.main import main\n"
        "main()\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: vllm bench serve [options]")
    assert "--dataset-name" in proc.stdout and "--request-rate" in proc.stdout
