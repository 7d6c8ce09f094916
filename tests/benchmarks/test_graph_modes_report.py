"""graph_modes_report: the CUDA graph modes' table from the folders gpu_check.sh's graph_modes
step writes (serving_sweep.py's sweep.json and `vllm bench serve` result files, made here
in their formats: the step stats by step_stats.summarize itself), and the step's shell:
the --server-args it gives serving_sweep (the --compilation-config JSON through shlex) and
the commands it runs."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import types

import pytest

from benchmarks.serving.graph_modes_report import FIGURES, main, summary
from benchmarks.serving.serving_sweep import PERCENTILES
from tests.utils import REPO
from vllm.benchmarks import step_stats
from vllm.benchmarks.metrics import calculate_metrics


def _steps(prefill: tuple[int, int], decode: tuple[int, int], split: bool = True) -> dict:
    """server_step_stats of a run with (graph, eager) steps with prefill and decode-only."""
    totals = dict.fromkeys(step_stats.TOTAL_KEYS, 0.0)
    totals.update(steps=sum(prefill) + sum(decode), prefill_steps=sum(prefill))
    totals.update(step_s=2.0, prefill_step_s=1.0, prefill_tokens=5000.0, decode_tokens=9000.0)
    if split:
        totals.update(graph_steps=prefill[0] + decode[0], prefill_graph_steps=prefill[0])
    return step_stats.summarize(totals, 10.0)


def _result(tok, ttft, ttft99, itl, itl99, steps=None) -> dict:
    """A `vllm bench serve` result as serving_sweep's runs save it (the figures read, some
    others, the sweep's metadata)."""
    res = {"date": "20250101-000000", "backend": "openai", "num_prompts": 300, "completed": 300}
    res.update(failed=0, duration=10.0, output_throughput=tok, request_throughput=30.0)
    res.update(median_ttft_ms=ttft, p99_ttft_ms=ttft99, median_itl_ms=itl, p99_itl_ms=itl99)
    res.update(mean_ttft_ms=ttft, mean_itl_ms=itl, conv_backend="triton", workload="sharegpt")
    if steps is not None:
        res["server_step_stats"] = steps
    return res


def _sweep(folder, startup, runs: dict, repeats: int) -> None:
    """``folder``/sweep.json and the result files, as serving_sweep.py writes them: ``runs``
    maps an item (conv1-sharegpt-rate8) to its repeats' results; None for a failed run,
    "skip" for one over the budget."""
    folder.mkdir(parents=True)
    records = [
        {
            "name": "server conv1",
            "log": "server-conv1.log",
            "engine_process": "1",
            "triton_cache": "fresh, empty",
            "startup_s": startup,
        }
    ]
    for i in range(repeats):
        for item, results in runs.items():
            name = item + (f"-r{i}" if repeats > 1 else "")
            record = {"name": name, "item": item, "repeat": i, "prompts": 300}
            record["result"] = f"{name}.json"
            records.append(record)
            if results[i] == "skip":
                record["skipped"] = "over the 460.0 s budget"
                continue
            record.update(rc=1 if results[i] is None else 0, wall_s=45.0, log=f"{name}.log")
            if results[i] is not None:
                (folder / record["result"]).write_text(json.dumps(results[i]))
    records[0]["exit_status"] = 0
    sweep = {"argv": ["--model", ".whl/codestral"], "commit": "abc1234", "runs": records}
    (folder / "sweep.json").write_text(json.dumps(sweep, indent=2))


def test_the_report_reads_the_keys_vllm_bench_serve_writes():
    request = {"success": True, "output_tokens": 3, "prompt_len": 5, "ttft": 0.1, "latency": 0.3}
    request.update(itl=[0.1, 0.1], generated_text="abc", error="", cached_tokens=None)
    out = types.SimpleNamespace(**request, server_prompt_tokens=None)
    percentiles = [float(q) for q in PERCENTILES.split(",")]
    metrics = calculate_metrics([out], 1.0, None, ["ttft", "tpot", "itl", "e2el"], percentiles)
    assert set(FIGURES) <= set(metrics)
    assert {"num_steps_with_prefill_graph", "num_steps_decode_only_eager"} <= set(
        _steps((1, 2), (3, 4))
    )


def test_means_spread_and_ratios_per_workload(tmp_path, capsys):
    folder = tmp_path / "graph_modes"
    fdo = {
        "conv1-sharegpt-rate8": [
            _result(1000.0, 100.0, 300.0, 10.0, 30.0, _steps((0, 200), (900, 10))),
            _result(1100.0, 120.0, 340.0, 12.0, 48.0, _steps((0, 200), (900, 10))),
        ],
        "conv1-sharegpt-rateinf": [
            _result(3000.0, 900.0, 2000.0, 20.0, 80.0, _steps((0, 100), (400, 0))),
            _result(3000.0, 900.0, 2000.0, 20.0, 80.0, _steps((0, 100), (400, 0))),
        ],
    }
    full = {
        "conv1-sharegpt-rate8": [
            _result(1200.0, 50.0, 200.0, 10.0, 20.0, _steps((180, 20), (900, 10))),
            _result(1300.0, 70.0, 220.0, 10.0, 30.0, _steps((190, 10), (900, 10))),
        ],
        "conv1-sharegpt-rateinf": [
            _result(3300.0, 600.0, 1800.0, 20.0, 60.0, _steps((100, 0), (400, 0))),
            _result(3300.0, 600.0, 1800.0, 20.0, 60.0, _steps((100, 0), (400, 0))),
        ],
    }
    _sweep(folder / "FULL_DECODE_ONLY", 40.0, fdo, 2)
    _sweep(folder / "FULL", 55.0, full, 2)
    assert main([str(folder)]) == 0
    text = capsys.readouterr().out
    assert (folder / "graph_modes.md").read_text() == text
    lines = text.splitlines()
    assert lines[lines.index("## sharegpt@8") + 4 :][:2] == [
        "| FULL_DECODE_ONLY | 2 | 1050.0 ± 70.7 | 110.0 ± 14.1 / 320.0 ± 28.3 | 11.00 ± 1.41 / "
        "39.00 ± 12.73 | 3.50 ± 0.71 | 0 / 200 | 900 / 10 | 40.0 |",
        "| FULL | 2 | 1250.0 ± 70.7 | 60.0 ± 14.1 / 210.0 ± 14.1 | 10.00 ± 0.00 / 25.00 ± 7.07 "
        "| 2.50 ± 0.71 | 185 ± 7.1 / 15 ± 7.1 | 900 / 10 | 55.0 |",
    ]
    ratio = f"FULL/FULL_DECODE_ONLY (ratio of the means): TTFT median {60 / 110:.3f}, "
    assert ratio + f"output tok/s {1250 / 1050:.3f}" in lines
    assert ratio.replace(f"{60 / 110:.3f}", f"{600 / 900:.3f}") + "output tok/s 1.100" in lines
    assert "Missing:" not in text and "absent" not in text
    saved = json.loads((folder / "graph_modes.json").read_text())
    assert saved["modes"] == ["FULL_DECODE_ONLY", "FULL"] and saved["missing"] == []
    full8 = saved["workloads"]["sharegpt@8"]["FULL"]
    assert full8["output_throughput"]["values"] == [1200.0, 1300.0]
    assert full8["num_steps_with_prefill_graph"]["mean"] == 185.0
    assert saved["ratios"]["sharegpt@inf"]["FULL/FULL_DECODE_ONLY"] == pytest.approx(
        {"median_ttft_ms": 600 / 900, "output_throughput": 1.1}
    )


def test_missing_runs_folders_and_step_split_are_reported(tmp_path, capsys):
    folder = tmp_path / "graph_modes"
    no_split = _steps((0, 50), (300, 0), split=False)
    fdo = {"conv1-sharegpt-rate8": [_result(1000.0, 100.0, 300.0, 10.0, 30.0, no_split)]}
    full = {
        "conv1-sharegpt-rate8": [_result(1200.0, 50.0, 200.0, 10.0, 20.0)],
        "conv1-sharegpt-rateinf": [None],
        "conv1-512-rateinf": ["skip"],
    }
    _sweep(folder / "FULL_DECODE_ONLY", 40.0, fdo, 1)
    _sweep(folder / "FULL", 55.0, full, 1)
    (folder / "NONE").mkdir()  # the server died at start-up: no sweep.json
    assert main([str(folder), "--modes", "FULL", "FULL_DECODE_ONLY", "NONE", "PIECEWISE"]) == 1
    text = capsys.readouterr().out
    s = summary(folder, ["FULL", "FULL_DECODE_ONLY", "NONE", "PIECEWISE"])
    assert s["missing"] == [
        "FULL: conv1-sharegpt-rateinf failed (rc 1, conv1-sharegpt-rateinf.log)",
        "FULL: conv1-512-rateinf skipped (over the 460.0 s budget)",
        "NONE: no readable sweep.json (the sweep did not finish)",
        f"PIECEWISE: no folder {folder / 'PIECEWISE'}",
    ]
    assert all(f"- {m}" in text for m in s["missing"])
    rows = [line for line in text.splitlines() if line.startswith("| FULL")]
    assert rows[0].startswith("| FULL | 1 | 1200.0 | 50.0 / 200.0 | 10.00 / 20.00 | 2.00 |")
    assert rows[0].endswith("| absent / absent | absent / absent | 55.0 |")  # no step stats
    assert "| absent / absent | absent / absent | 40.0 |" in rows[1]  # stats without a split
    assert "absent: the result's server_step_stats has no graph / eager split" in text
    assert list(s["workloads"]) == ["sharegpt@8"]
    assert s["ratios"]["sharegpt@8"]["FULL/FULL_DECODE_ONLY"]["output_throughput"] == 1.2


def test_nothing_to_report(tmp_path, capsys):
    assert main([str(tmp_path / "absent")]) == 1
    assert "No run with a result." in capsys.readouterr().out


def _shell(script: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", f". scripts/gpu_steps/serving.sh\n{script}"],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        capture_output=True,
        text=True,
    )


def test_the_steps_server_args_carry_the_json_through_shlex():
    proc = _shell("graph_modes_server_args FULL")
    assert proc.returncode == 0, proc.stderr
    args = shlex.split(proc.stdout)  # as serving_sweep.start_server splits --server-args
    i = args.index("--compilation-config")
    assert args[i : i + 2] == ["--compilation-config", '{"cudagraph_mode": "FULL"}']
    assert json.loads(args[i + 1]) == {"cudagraph_mode": "FULL"}
    assert args[:4] == ["--load-format", "dummy", "--dtype", "bfloat16"]
    more = _shell("graph_modes_server_args FULL_DECODE_ONLY", {"GRAPH_MODES_SERVER_ARGS": "-x 1"})
    assert shlex.split(more.stdout)[-4:] == [
        "--compilation-config",
        '{"cudagraph_mode": "FULL_DECODE_ONLY"}',
        "-x",
        "1",
    ]


def test_the_servers_parser_takes_the_steps_server_args():
    from vllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    proc = _shell("graph_modes_server_args FULL", {"GRAPH_MODES_SERVER_ARGS": "--max-num-seqs 128"})
    args = parser.parse_args(shlex.split(proc.stdout))
    assert args.compilation_config.cudagraph_mode == "FULL"
    assert (args.max_num_seqs, args.load_format) == (128, "dummy")  # the last given wins


def test_the_step_runs_one_sweep_per_mode_then_the_report(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data.json").write_text("[]")
    # python3 records its arguments (NUL-separated, one file a call) instead of running;
    # the count goes through a file (a call in a pipe runs in a subshell).
    stub = """serve_wheels() { :; }
python3() {
    local n=$(($(cat "$out/n" 2>/dev/null || echo 0) + 1))
    echo "$n" >"$out/n"
    printf '%s\\0' "$@" >"$out/call$n"
}
graph_modes"""
    env = {"out": str(tmp_path), "SERVING_MODEL_DIR": str(tmp_path / "model")}
    env.update(SERVING_DATASET=str(tmp_path / "data.json"), GRAPH_MODES_REPEATS="2")
    proc = _shell(stub, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [(tmp_path / f"call{i}").read_text().split("\0")[:-1] for i in (1, 2, 3)]
    assert not (tmp_path / "call4").exists()
    for mode, call in zip(("FULL_DECODE_ONLY", "FULL"), calls, strict=False):
        assert call[:2] == ["-m", "benchmarks.serving.serving_sweep"]
        opts = dict(zip(call[2::2], call[3::2], strict=True))
        assert opts["--out"] == f"{tmp_path}/graph_modes/{mode}"
        assert opts["--runs"] == "sharegpt@8:300,sharegpt@inf:300"
        assert (opts["--conv-backends"], opts["--repeats"]) == ("1", "2")
        assert opts["--model"] == str(tmp_path / "model")
        server = shlex.split(opts["--server-args"])
        assert server[-2:] == ["--compilation-config", json.dumps({"cudagraph_mode": mode})]
    assert calls[2] == [
        "-m",
        "benchmarks.serving.graph_modes_report",
        f"{tmp_path}/graph_modes",
    ] + [
        "--modes",
        "FULL_DECODE_ONLY",
        "FULL",
    ]
    (tmp_path / "n").unlink()
    bad = _shell(stub, {**env, "GRAPH_MODES": "FULL 'x"})
    assert bad.returncode == 1 and "graph_modes: 'x is no cudagraph_mode name" in bad.stdout


def test_a_variant_mode_adds_its_options_and_an_unset_variant_is_refused(tmp_path):
    env = {"GRAPH_MODES_VARIANT_lpt512": "--long-prefill-token-threshold 512"}
    proc = _shell("graph_modes_server_args FULL+lpt512", {**env, "GRAPH_MODES_SERVER_ARGS": "-x 1"})
    assert proc.returncode == 0, proc.stderr
    args = shlex.split(proc.stdout)
    i = args.index("--compilation-config")
    assert json.loads(args[i + 1]) == {"cudagraph_mode": "FULL"}  # the mode without +NAME
    assert args[-4:] == ["-x", "1", "--long-prefill-token-threshold", "512"]
    plain = shlex.split(_shell("graph_modes_server_args FULL", env).stdout)
    assert "--long-prefill-token-threshold" not in plain
    stub = "serve_wheels() { :; }\npython3() { :; }\ngraph_modes"
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "data.json").write_text("[]")
    base = {"out": str(tmp_path), "SERVING_MODEL_DIR": str(tmp_path)}
    base["SERVING_DATASET"] = str(tmp_path / "data.json")
    bad = _shell(stub, {**base, "GRAPH_MODES": "FULL+nope"})
    assert bad.returncode == 1
    assert "FULL+nope names a variant but GRAPH_MODES_VARIANT_nope is not set" in bad.stdout
