"""old_new_report: the old-against-new table from the files gpu_check.sh's old_new step writes."""

import json

from benchmarks.engine.old_new_report import markdown, rows


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _throughput(tok, prefill, startup):
    return {"output_tokens_per_s": tok, "prefill_tokens_per_s": prefill, "startup_s": startup}


def _sweep(folder, tree, startup, outputs, skipped=False):
    runs = [{"name": "server conv1", "startup_s": startup}]
    for i, tok in enumerate(outputs):
        runs.append({"name": f"conv1-sharegpt-rateinf-r{i}", "result": f"r{i}.json"})
        _write(folder / f"{tree}-sweep" / f"r{i}.json", {"output_throughput": tok})
    if skipped:
        runs.append({"name": "late", "result": "late.json", "skipped": "over the budget"})
    _write(folder / f"{tree}-sweep" / "sweep.json", {"runs": runs})


def test_means_and_ratios_per_figure(tmp_path):
    _write(tmp_path / "old-throughput-r0.json", _throughput(3800.0, 33000.0, 20.0))
    _write(tmp_path / "old-throughput-r1.json", _throughput(3900.0, 34000.0, 22.0))
    _write(tmp_path / "new-throughput-r0.json", _throughput(3850.0, 33500.0, 20.0))
    _write(tmp_path / "new-throughput-r1.json", _throughput(3950.0, 34500.0, 21.0))
    _sweep(tmp_path, "old", 30.0, [3700.0, 3720.0], skipped=True)
    _sweep(tmp_path, "new", 27.0, [3740.0, 3760.0])
    table = {r[0]: r for r in rows(tmp_path)}
    assert table["output tok/s"][1] == "3,850.0 (3,800.0, 3,900.0)"
    assert table["output tok/s"][3] == f"{3900.0 / 3850.0:.3f}"
    assert table["prefill tok/s"][3] == f"{34000.0 / 33500.0:.3f}"
    assert table["start-up s"][3] == f"{20.5 / 21.0:.3f}"
    # the skipped run (no result file) is not counted as a run
    assert table["server output tok/s"][1] == "3,710.0 (3,700.0, 3,720.0)"
    assert table["server output tok/s"][3] == f"{3750.0 / 3710.0:.3f}"
    assert table["server start-up s"][3] == f"{27.0 / 30.0:.3f}"


def test_a_tree_without_runs_gives_no_ratio(tmp_path):
    _write(tmp_path / "new-throughput-r0.json", _throughput(3850.0, 33500.0, 20.0))
    (tmp_path / "old-throughput-r0.json").write_text("{not json")  # a run that crashed mid-write
    table = {r[0]: r for r in rows(tmp_path)}
    assert table["output tok/s"][1:] == ["no run", "3,850.0 (3,850.0)", "-"]
    assert table["server output tok/s"][1:] == ["no run", "no run", "-"]
    text = markdown(tmp_path)
    assert text.startswith("| figure | old: mean (runs) | new: mean (runs) | new / old |")
    assert len(text.strip().splitlines()) == 2 + 5
