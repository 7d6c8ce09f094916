"""benchmarks/upstream/extract_vllm033.py on a tiny fake vllm wheel: the ops modules an entry
reaches are extracted with their vllm imports pointed at siblings or at the shims (lines
kept in place), the fused-MoE module is cut down to the named definitions and what they
use, the launch tables of the given shapes are copied, the result imports in a fresh
process and its shims answer as on an H200; an import the extractor does not handle stops
it, naming the file, the line and the statement."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

from benchmarks.common.launch import tree_env
from benchmarks.upstream import extract_vllm033 as ex
from benchmarks.upstream import vllm033_shims as shims

OPS = "vllm/model_executor/layers/mamba/ops"
MOD_A = """\
import torch
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.model_executor.layers.mamba.ops.mod_b import (
    helper,  # the sibling's
)
import vllm.envs as envs
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID, PAD_SLOT_ID as PAD

SM90 = current_platform.is_device_capability(90)
FOLDER = envs.VLLM_TUNED_CONFIG_FOLDER


def value():
    return helper() + NULL_BLOCK_ID + PAD + tl.constexpr(0).value
"""
MOD_B = """\
from vllm.logger import init_logger
from vllm.triton_utils import triton

logger = init_logger(__name__)


def helper():
    logger.info_once("said once", scope="global")
    return triton.cdiv(83, 2)
"""
MOE = """\
import os

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.logger import init_logger
from vllm.triton_utils import tl, triton

logger = init_logger(__name__)


@triton.jit
def fused_moe_kernel(a_ptr, BLOCK: tl.constexpr):
    pass


def _block(M):
    return 16 if M < 64 else 64


def get_default_config(M):
    return {"BLOCK_SIZE_M": _block(M), "here": os.path.basename(__file__)}


class NotWanted(mk.FusedMoEPermuteExpertsUnpermute):
    pass
"""


def fake_wheel(path, mod_a=MOD_A, version="0.33.0"):
    files = {
        f"vllm-{version}.dist-info/METADATA": f"Name: vllm\nVersion: {version}\n",
        f"{OPS}/mod_a.py": mod_a,
        f"{OPS}/mod_b.py": MOD_B,
        f"{OPS}/unreached.py": "from vllm.foo import bar\n",
        f"{OPS}/configs/selective_state_update/headdim=64,dstate=128.json": "{}",
        ex.MOE_FILE: MOE,
        f"{ex.MOE_CONFIGS}E=4,N=8,device_name=NVIDIA_H200.json": '{"1": {}}',
        f"{ex.MOE_CONFIGS}E=5,N=8,device_name=NVIDIA_H200.json": '{"1": {}}',
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def run_extract(wheel, out, check=True):
    return ex.extract(wheel, out, ops_entries=("mod_a",), shapes=[(4, 8)], check=check,
                      moe_names=("fused_moe_kernel", "get_default_config", "tl"))  # fmt: skip


def test_extracts_rewrites_and_imports(tmp_path):
    out = tmp_path / "out"
    res = run_extract(fake_wheel(tmp_path / "vllm-0.33.0-fake.whl"), out)
    pkg = out / ex.PACKAGE
    assert res["ops"] == ["mod_a", "mod_b"]  # followed from mod_a; unreached.py left out
    assert res["moe_tables"] == ["E=4,N=8,device_name=NVIDIA_H200.json"]
    assert (pkg / "ops/configs/selective_state_update/headdim=64,dstate=128.json").is_file()
    a = (pkg / "ops/mod_a.py").read_text()
    assert len(a.splitlines()) == len(MOD_A.splitlines())  # upstream's line numbers kept
    for line in ("from ..shims import current_platform", "from ..shims import tl, triton",
                 "from .mod_b import (", "from ..shims import envs",
                 "from ..shims import NULL_BLOCK_ID, PAD_SLOT_ID as PAD"):  # fmt: skip
        assert line + "\n" in a, line
    assert "vllm" not in a.replace("vllm.envs", "")
    assert "from ..shims import init_logger" in (pkg / "ops/mod_b.py").read_text()
    moe = (pkg / "fused_moe/fused_moe.py").read_text()
    assert "def _block(M)" in moe and "import os" in moe and "logger" not in moe
    assert "NotWanted" not in moe and "modular_kernel" not in moe and "mk" not in moe
    assert (pkg / "shims.py").read_text() == ex.SHIMS_SOURCE.read_text()
    readme = (pkg / "README.txt").read_text()
    assert "vllm-0.33.0-fake.whl" in readme and "NEVER commit" in readme
    assert not (out / f".{ex.PACKAGE}.tmp").exists()
    code = textwrap.dedent("""
        from upstream_vllm033.ops import mod_a
        from upstream_vllm033.fused_moe import fused_moe as moe
        print(mod_a.SM90, mod_a.value(), mod_a.FOLDER, moe.get_default_config(1))
    """)
    env = tree_env(VLLM_TUNED_CONFIG_FOLDER="/tuned")
    env["PYTHONPATH"] = os.pathsep.join([str(out), env["PYTHONPATH"]])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # 42 + NULL_BLOCK_ID 0 + PAD_SLOT_ID -1 + 0; sm_90 without a GPU (and on an H100/H200)
    expected = "True 41 /tuned {'BLOCK_SIZE_M': 16, 'here': 'fused_moe.py'}"
    assert done.stdout.strip() == expected


@pytest.mark.parametrize(
    "line, what",
    [
        ("from vllm.foo import bar", "unhandled import: from vllm.foo import bar"),
        ("from vllm.platforms import cuda_only", "unhandled import of cuda_only"),
        ("import vllm.envs", "unhandled import: import vllm.envs"),
        ("from vllm.model_executor.layers.mamba.ops import mod_b", "unhandled import"),
        ("from ..mamba import thing", "unhandled relative import"),
    ],
)
def test_an_unhandled_import_stops_it_naming_file_and_statement(tmp_path, line, what):
    mod_a = MOD_A.replace("import torch\n", f"import torch\nif False:\n    {line}\n")
    wheel = fake_wheel(tmp_path / "w.whl", mod_a)
    with pytest.raises(ex.ExtractError) as err:
        run_extract(wheel, tmp_path / "out", check=False)
    assert f"{OPS}/mod_a.py:3: " in str(err.value) and what in str(err.value)
    assert not (tmp_path / "out" / ex.PACKAGE).exists()
    assert not (tmp_path / "out" / f".{ex.PACKAGE}.tmp").exists()


def test_a_shim_attribute_the_shims_lack_stops_it(tmp_path):
    mod_a = MOD_A + "X = envs.VLLM_NOT_SHIMMED\nY = current_platform.is_tpu()\n"
    with pytest.raises(ex.ExtractError, match=r"mod_a.py:16: the shims' envs lacks VLLM_NOT_"):
        run_extract(fake_wheel(tmp_path / "w.whl", mod_a), tmp_path / "out", check=False)


def test_the_command_refuses_another_version(tmp_path, capsys):
    wheel = fake_wheel(tmp_path / "w.whl", version="0.34.0")
    assert ex.main([str(wheel), "--out", str(tmp_path / "out"), "--no-check"]) == 1
    assert "w.whl is vllm 0.34.0, not 0.33.0" in capsys.readouterr().err


def test_every_shim_the_tables_name_exists_and_answers_as_an_h200():
    for module, names in ex.SHIMS.items():
        for name, shim in names.items():
            assert shim in vars(shims), (module, name, shim)
    assert all(shim in vars(shims) for shim in ex.IMPORT_AS.values())
    assert ex.moe_shapes() == [(72, 768), (128, 1856)]  # benchmark_fused_moe's SHAPES
    platform = shims.current_platform
    if not platform.is_cuda() or not hasattr(shims.torch, "cuda"):
        pytest.fail("the shims' platform is CUDA")
    if not shims.torch.cuda.is_available():
        assert platform.get_device_capability() == (9, 0)
        assert shims.get_device_name_as_file_name() == "NVIDIA_H200"
    assert platform.is_device_capability(90) == platform.is_device_capability((9, 0))
    assert not platform.is_device_capability_family(100) and not platform.is_rocm()
    with pytest.raises(AttributeError, match="envs.VLLM_OTHER"):
        shims.envs.VLLM_OTHER  # noqa: B018
    with pytest.raises(NotImplementedError, match="vllm._custom_ops.selective_scan_fwd"):
        shims.custom_ops.selective_scan_fwd()
    assert shims.next_power_of_2(5) == 8 and shims.next_power_of_2(8) == 8
