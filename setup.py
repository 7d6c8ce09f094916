"""Packaging for `vllm`: Python, plus the CMake-built CUDA ops where they can be built.

`pip install -e .` works on a CPU-only machine, as pure Python. On the GPU box, where
torch and triton come preinstalled and there is no network, use
`pip install --no-deps --no-build-isolation -e .`: it also builds the CUDA ops of csrc/
(CMakeLists.txt) into vllm/_C_conv*.so. `should_build_cuda_ops` decides;
VLLM_BUILD_CUDA_OPS=0/1 overrides it.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def read_version() -> str:
    # vllm/__init__.py holds the one copy of the version; read it as text so that the build
    # never imports the package it is building.
    text = (ROOT / "vllm" / "__init__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    if match is None:
        raise RuntimeError('vllm/__init__.py has no line __version__ = "..."')
    return match.group(1)


def read_requirements(name: str) -> list[str]:
    """The requirement lines of requirements/<name>, following `-r other.txt` includes."""
    requirements = []
    for raw in (ROOT / "requirements" / name).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            requirements += read_requirements(line[len("-r ") :].strip())
        else:
            requirements.append(line)
    return requirements


MIN_CMAKE = (3, 25)


def load_envs():
    """vllm/envs.py as a standalone module: the one place that reads environment variables,
    loaded by path so that the build never imports the package it is building."""
    spec = importlib.util.spec_from_file_location("_vllm_envs", ROOT / "vllm" / "envs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def find_nvcc() -> Path | None:
    """nvcc of a CUDA toolkit: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, then PATH (where
    `nvcc` may be a wrapper script outside any toolkit)."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return Path(root) / "bin" / "nvcc"
    found = shutil.which("nvcc")
    return Path(found) if found else None


def cmake_version(cmake: str) -> tuple[int, ...] | None:
    try:
        text = subprocess.run(
            [cmake, "--version"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"version (\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def cuda_build_blockers() -> list[str]:
    """Why the CUDA ops cannot be built in this environment; empty when they can."""
    blockers = []
    cmake = shutil.which("cmake")
    if cmake is None:
        blockers.append("cmake is not on PATH")
    else:
        version = cmake_version(cmake)
        if version is None or version < MIN_CMAKE:
            shown = ".".join(map(str, version)) if version else "of unknown version"
            blockers.append(f"cmake {shown} is older than {'.'.join(map(str, MIN_CMAKE))}")
    if find_nvcc() is None:
        blockers.append("nvcc was not found (CUDA_HOME, CUDA_PATH, PATH)")
    try:
        import torch
    except ImportError:
        blockers.append(
            "torch is not importable by the build (isolated build environment? install "
            "with --no-build-isolation)"
        )
    else:
        if torch.version.cuda is None:
            blockers.append(f"torch {torch.__version__} is not a CUDA build")
    return blockers


def should_build_cuda_ops() -> bool:
    """Whether this install builds the CUDA ops of csrc/ with CMake (see CMakeLists.txt).

    VLLM_BUILD_CUDA_OPS=0 never builds them; =1 always does, and fails with the reason
    when it cannot. Unset, they are built when torch is a CUDA build, nvcc is found and
    cmake >= 3.25 is on PATH; otherwise (the CPU machines: a CPU torch, or no torch in
    pip's isolated build environment) the install is pure Python.
    """
    wanted = load_envs().VLLM_BUILD_CUDA_OPS
    if wanted is False:
        print("vllm setup: VLLM_BUILD_CUDA_OPS=0, not building the CUDA ops", file=sys.stderr)
        return False
    blockers = cuda_build_blockers()
    if blockers and wanted:
        raise RuntimeError(
            "VLLM_BUILD_CUDA_OPS=1 but the CUDA ops cannot be built: " + "; ".join(blockers)
        )
    if blockers:
        print(
            "vllm setup: pure Python install, without the CUDA ops: " + "; ".join(blockers),
            file=sys.stderr,
        )
        return False
    return True


class CMakeExtension(Extension):
    """A library built by CMakeLists.txt rather than by setuptools' compiler."""

    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configure and build CMakeLists.txt so that the library lands at the extension's path.

    setuptools then copies it into the source tree for editable installs
    (vllm/_C_conv.<python extension suffix>), where vllm/_custom_ops.py loads it.
    """

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)
            return
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        nvcc = find_nvcc()
        configure = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DCONV_OUTPUT_DIR={target.parent}",
            f"-DCONV_OUTPUT_NAME={target.name}",
        ]
        toolkit = nvcc.parent.parent
        if (toolkit / "include" / "cuda_runtime.h").is_file():
            # Torch's CMake config looks for the toolkit (FindCUDA) with this hint.
            configure.append(f"-DCUDA_TOOLKIT_ROOT_DIR={toolkit}")
        if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja"]
        subprocess.run(configure, check=True)
        jobs = str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel", jobs], check=True)
        if not target.is_file():
            raise RuntimeError(f"the CMake build did not produce {target}")


setup(
    name="vllm",
    version=read_version(),
    description="Mamba2 inference in vLLM's layout, with Triton causal-conv1d kernels",
    packages=find_packages(include=["vllm", "vllm.*"]),
    # Launch tables (vllm/triton_utils/configs.py) travel in the wheel beside their kernels.
    package_data={"vllm": ["**/configs/**/*.json"]},
    python_requires=">=3.10",
    install_requires=read_requirements("common.txt"),
    entry_points={"console_scripts": ["vllm=vllm.entrypoints.cli.main:main"]},
    **(
        dict(ext_modules=[CMakeExtension("vllm._C_conv")], cmdclass={"build_ext": CMakeBuild})
        if should_build_cuda_ops()
        else {}
    ),
)
