"""vllm.triton_utils.configs: per-device launch tables read from JSON files."""

import json

import pytest
import torch

from vllm.triton_utils import configs


def test_lookup_falls_back_from_key_to_wildcard(tmp_path):
    configs.write_table(
        tmp_path / "default.json",
        {"dstate=128,dtype=bfloat16": {"BLOCK_N": 64, "num_warps": 4}, "*": {"BLOCK_N": 32}},
        {"command": "test"},
    )
    key = configs.table_key(dtype=torch.bfloat16, dstate=128)
    assert key == "dstate=128,dtype=bfloat16"
    got = configs.lookup(tmp_path, key)
    assert got == {"BLOCK_N": 64, "num_warps": 4}
    got["BLOCK_N"] = 1  # a copy: the table is unchanged
    assert configs.lookup(tmp_path, key)["BLOCK_N"] == 64
    assert configs.lookup(tmp_path, "dstate=256") == {"BLOCK_N": 32}


def test_missing_entry_names_folder_and_key(tmp_path):
    configs.write_table(tmp_path / "default.json", {"a=1": {}}, {})
    with pytest.raises(KeyError, match="b=2"):
        configs.lookup(tmp_path, "b=2")


def test_table_without_entries_is_refused(tmp_path):
    (tmp_path / "default.json").write_text(json.dumps({"meta": {}}))
    configs._read.cache_clear()
    with pytest.raises(ValueError, match="entries"):
        configs.lookup(tmp_path, "a=1")


def test_device_file_name_without_cuda():
    if torch.cuda.is_available():
        assert configs.device_file_name() == configs.device_file_name(0)
        assert " " not in configs.device_file_name()
    else:
        assert configs.device_file_name() == "default"
