"""Packaging for `vllm`: pure Python today, with a hook for the CMake-built CUDA ops.

`pip install -e .` works on a CPU-only machine. On the GPU box, where torch and triton
come preinstalled and there is no network, use
`pip install --no-deps --no-build-isolation -e .`.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

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


def should_build_cuda_ops() -> bool:
    """Whether this install builds the CUDA ops of csrc/ with CMake.

    Always False for now: the CUDA pathway (csrc/, CMakeLists.txt, a CMake build_ext)
    comes with a later issue. When it does, this decides from the environment, and it
    must keep saying False on the CPU machines, which have no CUDA build of torch and
    only cmake 3.25, so that they still install as pure Python.
    """
    return False


if should_build_cuda_ops():
    raise RuntimeError("this source tree has no CUDA ops to build yet")

setup(
    name="vllm",
    version=read_version(),
    description="Mamba2 inference in vLLM's layout, with Triton causal-conv1d kernels",
    packages=find_packages(include=["vllm", "vllm.*"]),
    python_requires=">=3.10",
    install_requires=read_requirements("common.txt"),
)
