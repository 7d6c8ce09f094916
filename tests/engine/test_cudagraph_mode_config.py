"""``compilation_config`` with vLLM's ``cudagraph_mode``: ``EngineConfig`` reads it from a
dict, its JSON or a ``CompilationConfig`` (any case), refuses an unknown key or mode by
name, lets ``enforce_eager`` win (with a warning) and defaults to FULL;
``--compilation-config`` / ``-cc`` (``EngineArgs``, ``vllm serve``) and
``LLM(compilation_config=...)`` pass it through."""

from __future__ import annotations

import argparse
import json
import logging
import pickle

import pytest

from tests.engine.utils import STREAMS_CONFIG as CONFIG
from vllm import LLM, SamplingParams
from vllm.config import CUDAGRAPH_MODES, CompilationConfig, EngineConfig
from vllm.engine.arg_utils import EngineArgs

MODES_MESSAGE = "give one of NONE, FULL_DECODE_ONLY, FULL"


def make_config(**kw) -> EngineConfig:
    return EngineConfig(CONFIG, load_format="dummy", device="cpu", **kw)


@pytest.fixture
def vllm_log(caplog):
    """caplog, with the "vllm" logger's records (it does not propagate to the root)."""
    root = logging.getLogger("vllm")
    root.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm"):
            yield caplog
    finally:
        root.removeHandler(caplog.handler)


def test_the_default_is_full():
    config = make_config()
    assert config.cudagraph_mode == "FULL"
    assert config.compilation_config == CompilationConfig(cudagraph_mode=None)
    assert CUDAGRAPH_MODES == ("NONE", "FULL_DECODE_ONLY", "FULL")


@pytest.mark.parametrize(
    "value, stored, mode",
    [
        ({"cudagraph_mode": "FULL"}, "FULL", "FULL"),
        ({"cudagraph_mode": "full"}, "FULL", "FULL"),
        ({"cudagraph_mode": "Full_Decode_Only"}, "FULL_DECODE_ONLY", "FULL_DECODE_ONLY"),
        ({"cudagraph_mode": "none"}, "NONE", "NONE"),
        ({"cudagraph_mode": None}, None, "FULL"),
        ({}, None, "FULL"),
        ('{"cudagraph_mode": "full"}', "FULL", "FULL"),
        ("{}", None, "FULL"),
        (CompilationConfig(cudagraph_mode="fUlL"), "FULL", "FULL"),
        (CompilationConfig(), None, "FULL"),
        (None, None, "FULL"),
    ],
)
def test_dict_json_and_dataclass_any_case(value, stored, mode):
    config = make_config(compilation_config=value)
    assert config.cudagraph_mode == mode
    assert config.compilation_config == CompilationConfig(cudagraph_mode=stored)
    # The checked config crosses to worker and engine-core processes as a pickle.
    assert pickle.loads(pickle.dumps(config.compilation_config)) == config.compilation_config


@pytest.mark.parametrize(
    "value, unknown",
    [
        ({"level": 3}, "'level'"),
        ({"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1]}, "'cudagraph_capture_sizes'"),
        ('{"use_inductor": false, "mode": 3}', "'use_inductor', 'mode'"),
    ],
)
def test_an_unknown_key_is_named(value, unknown):
    with pytest.raises(ValueError) as err:
        make_config(compilation_config=value)
    assert str(err.value) == (
        f"compilation_config key(s) {unknown} not supported; accepted: cudagraph_mode, "
        "max_cudagraph_capture_size"
    )


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE", "full-decode", "", 2])
def test_a_bad_mode_is_named_with_the_valid_ones(mode):
    expected = f"compilation_config cudagraph_mode {mode!r} is not supported: {MODES_MESSAGE}"
    with pytest.raises(ValueError) as err:
        make_config(compilation_config={"cudagraph_mode": mode})
    assert str(err.value) == expected
    with pytest.raises(ValueError) as err:
        CompilationConfig(cudagraph_mode=mode)
    assert str(err.value) == expected


@pytest.mark.parametrize("value", ["{cudagraph_mode: FULL}", "FULL", ""])
def test_bad_json_is_refused(value):
    with pytest.raises(ValueError) as err:
        make_config(compilation_config=value)
    message = str(err.value)
    assert message.startswith("compilation_config: bad JSON (") and message.endswith(repr(value))


@pytest.mark.parametrize("value", ["[1, 2]", "3", 3, ["cudagraph_mode"]])
def test_not_a_mapping_is_refused(value):
    with pytest.raises(ValueError) as err:
        make_config(compilation_config=value)
    assert str(err.value).startswith("compilation_config must be a dict (or JSON object), got ")


def test_enforce_eager_wins_with_a_warning(vllm_log):
    config = make_config(enforce_eager=True, compilation_config={"cudagraph_mode": "full"})
    assert config.cudagraph_mode == "NONE"
    assert config.compilation_config.cudagraph_mode == "FULL"  # what was asked, kept
    [record] = [r for r in vllm_log.records if "enforce_eager" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "enforce_eager wins over compilation_config: cudagraph_mode FULL ignored, NONE used "
        "(no CUDA graphs)"
    )


@pytest.mark.parametrize("value", [None, {"cudagraph_mode": "NONE"}, {}])
def test_enforce_eager_alone_or_with_none_does_not_warn(vllm_log, value):
    assert make_config(enforce_eager=True, compilation_config=value).cudagraph_mode == "NONE"
    assert not [r for r in vllm_log.records if "enforce_eager" in r.getMessage()]


def test_none_without_enforce_eager():
    config = make_config(compilation_config={"cudagraph_mode": "none"})
    assert config.cudagraph_mode == "NONE" and config.enforce_eager is False


def _engine_config(argv: list[str]) -> EngineConfig:
    args = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv)
    args.model = CONFIG
    return EngineArgs.from_cli_args(args).create_engine_config()


@pytest.mark.parametrize("flag", ["--compilation-config", "-cc"])
def test_cli_flag_through_engine_args(flag):
    argv = ["--load-format", "dummy", "--device", "cpu"]
    config = _engine_config([*argv, flag, json.dumps({"cudagraph_mode": "full"})])
    assert config.cudagraph_mode == "FULL"
    assert _engine_config([*argv, flag, '{"cudagraph_mode": "NONE"}']).cudagraph_mode == "NONE"
    assert _engine_config(argv).cudagraph_mode == "FULL"
    eager = _engine_config([*argv, "--enforce-eager", flag, '{"cudagraph_mode": "FULL"}'])
    assert eager.cudagraph_mode == "NONE"


@pytest.mark.parametrize(
    "text, message",
    [
        ("{'cudagraph_mode': 'FULL'}", "compilation_config: bad JSON ("),
        ('{"cudagraph_mode": "PIECEWISE"}', "compilation_config cudagraph_mode 'PIECEWISE'"),
        ('{"level": 3}', "compilation_config key(s) 'level' not supported"),
    ],
)
def test_cli_errors_name_the_flag(capsys, text, message):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(prog="vllm"))
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["-cc", text])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"vllm: error: argument --compilation-config/-cc: {message}" in err, err


def test_vllm_serve_parser_takes_the_flag():
    from vllm.entrypoints.openai.api_server import make_arg_parser

    parser = make_arg_parser(argparse.ArgumentParser(), positional_model=True)
    args = parser.parse_args(["some/model", "-cc", '{"cudagraph_mode": "Full"}'])
    assert args.compilation_config == CompilationConfig(cudagraph_mode="FULL")
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.compilation_config == CompilationConfig(cudagraph_mode="FULL")
    assert parser.parse_args(["some/model"]).compilation_config is None


def test_llm_passes_it_through():
    llm = LLM(CONFIG, load_format="dummy", dtype="float32", device="cpu", max_num_seqs=2,
              max_num_batched_tokens=16, max_model_len=32,
              compilation_config={"cudagraph_mode": "full"})  # fmt: skip
    assert llm.llm_engine.config.cudagraph_mode == "FULL"
    [out] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), False)
    assert len(out.outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="compilation_config key"):
        LLM(CONFIG, load_format="dummy", device="cpu", compilation_config={"levels": 3})


def test_max_cudagraph_capture_size():
    assert make_config().compilation_config.capture_size == 2048
    config = make_config(compilation_config='{"cudagraph_mode": "FULL", '
                         '"max_cudagraph_capture_size": 512}')  # fmt: skip
    assert config.compilation_config.capture_size == 512 and config.cudagraph_mode == "FULL"
    for bad in (0, -3, 2.5, True, "512"):
        with pytest.raises(ValueError, match="max_cudagraph_capture_size must be a positive"):
            make_config(compilation_config={"max_cudagraph_capture_size": bad})
