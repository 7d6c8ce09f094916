"""The seed's accuracy protocol: lm-eval's vllm backend once per conv backend, per-sample agreement.

    python -m benchmarks.accuracy.lm_eval_compare run --model-dir DIR --out OUT \
        [--load-format dummy]
    python -m benchmarks.accuracy.lm_eval_compare compare OUT/triton OUT/cuda [--json F --md F]
    python -m benchmarks.accuracy.lm_eval_compare pack-wheels .whl/lmeval .whl/lmeval.tar.xz
    python -m benchmarks.accuracy.lm_eval_compare unpack-wheels .whl/lmeval.tar.xz \
        /tmp/lmeval_wheels

``run`` writes the local tasks (tests/lm_eval/tasks.py: gsm8k_local, generate-until, 5-shot,
256 new tokens as gsm8k; mc_local, loglikelihood; ``--num-test`` documents each) into OUT/tasks and
runs, for VLLM_USE_TRITON_CONV1D=1 (triton) and =0 (cuda, the CUDA split), the seed's command

    lm_eval --model vllm --model_args pretrained=DIR,tensor_parallel_size=1,dtype=auto,
        gpu_memory_utilization=0.9[,load_format=dummy] --batch_size auto
        --tasks gsm8k_local,mc_local --include_path OUT/tasks --log_samples --output_path OUT/B

offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE), then ``compare``: per task, how many samples
have identical outputs (the generated text; every choice's loglikelihood), how many the same
prediction (gsm8k's extracted answer, mc's chosen answer), each side's metrics, and the
largest loglikelihood difference. With random weights the scores mean nothing; agreement is
the point. Results: OUT/compare.json and OUT/compare.md.

``pack-wheels`` / ``unpack-wheels`` carry lm-eval's run-time wheels to the GPU box inside the
device tool's 64 MiB: wheels are zips of deflated files, so they are unpacked into one xz
stream (87 -> 48 MiB) and zipped back (stored) on the box: the same files, so each wheel's
RECORD hashes hold and pip installs them as any wheel (docs/lm_eval.md).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from benchmarks.common.run_info import cuda_skip_reason, git_sha

BACKENDS = {"triton": "1", "cuda": "0"}
TASKS = ("gsm8k_local", "mc_local")


def model_args(model_dir: str, dtype: str, load_format: str | None, extra: str | None) -> str:
    args = f"pretrained={model_dir},tensor_parallel_size=1,dtype={dtype},gpu_memory_utilization=0.9"
    if load_format:
        args += f",load_format={load_format}"
    return args + (f",{extra}" if extra else "")


def run(args) -> int:
    from tests.lm_eval.tasks import write_tasks

    out = Path(args.out).resolve()
    tasks = write_tasks(
        out / "tasks",
        num_test=args.num_test,
        num_fewshot=args.num_fewshot,
        max_gen_toks=args.max_gen_toks,
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["HF_DATASETS_CACHE"] = str(out / "hf_datasets")
    model_dir = str(Path(args.model_dir).resolve())
    margs = model_args(model_dir, args.dtype, args.load_format, args.model_args)
    backends = args.backends.split(",")
    if "cuda" in backends:
        import torch

        reason = cuda_skip_reason(torch.cuda.is_available())
        if reason:
            sys.exit(f"cannot run the cuda backend: {reason}")
    for backend in backends:
        dest = out / backend
        if dest.exists() and any(dest.rglob("samples_*.jsonl")):
            sys.exit(f"{dest} holds an earlier run: give a fresh --out")
        cmd = [
            *(sys.executable, "-m", "lm_eval", "--model", "vllm", "--model_args", margs),
            *("--batch_size", "auto", "--tasks", ",".join(TASKS), "--include_path", str(tasks)),
            *("--log_samples", "--output_path", str(dest)),
        ]
        if args.limit is not None:
            cmd += ["--limit", str(args.limit)]
        flag = BACKENDS[backend]
        print(f"[{backend}] VLLM_USE_TRITON_CONV1D={flag} {' '.join(cmd[2:])}", flush=True)
        rc = subprocess.run(cmd, env={**env, "VLLM_USE_TRITON_CONV1D": flag}).returncode
        if rc != 0:
            print(f"[{backend}] lm_eval exited with {rc}", file=sys.stderr)
            return rc
    if len(backends) == 2:
        result = compare(out / backends[0], out / backends[1])
        result["command"] = {
            "model_args": margs,
            **{k: getattr(args, k) for k in ("num_test", "num_fewshot", "max_gen_toks", "limit")},
        }
        write(result, out / "compare.json", out / "compare.md")
    return 0


def load_run(run_dir: Path) -> tuple[dict, dict[str, dict]]:
    """(lm-eval's results.json, {task: {(doc_id, filter): sample}}) of one run's output."""
    found = list(run_dir.rglob("results_*.json"))
    if len(found) != 1:
        sys.exit(f"{run_dir}: {len(found)} results_*.json files (give one run's --output_path)")
    [results] = found
    samples = {}
    for task in TASKS:
        files = list(run_dir.rglob(f"samples_{task}_*.jsonl"))
        if len(files) != 1:
            sys.exit(f"{run_dir}: {len(files)} samples_{task}_*.jsonl files, expected one")
        rows = [json.loads(line) for line in files[0].read_text().splitlines() if line]
        samples[task] = {(r["doc_id"], r["filter"]): r for r in rows}
    return json.loads(results.read_text()), samples


def _loglikelihoods(sample: dict) -> list[float]:
    return [float(resp[0][0]) for resp in sample["resps"]]


def compare_task(a: dict, b: dict, mc: bool) -> dict:
    """Per document: identical outputs (every resp), and per filter the same prediction (the
    filtered answer: gsm8k's extracted number, mc's chosen choice)."""
    if a.keys() != b.keys():
        sys.exit("the two runs scored different documents (give both the same tasks and limit)")
    docs = sorted({doc for doc, _ in a})
    filters = sorted({f for _, f in a})
    identical, same = 0, dict.fromkeys(filters, 0)
    max_diff, differing = 0.0, []
    for doc in docs:
        x, y = a[(doc, filters[0])], b[(doc, filters[0])]
        if mc:
            lx, ly = _loglikelihoods(x), _loglikelihoods(y)
            max_diff = max(max_diff, *(abs(p - q) for p, q in zip(lx, ly, strict=True)))
        if x["resps"] == y["resps"]:
            identical += 1
        elif len(differing) < 5:
            differing.append({"doc_id": doc, "a": x["resps"], "b": y["resps"]})
        for f in filters:
            same[f] += _prediction(a[(doc, f)], mc) == _prediction(b[(doc, f)], mc)
    n = len(docs)
    row = {
        "documents": n,
        "identical": identical,
        "identical_pct": 100.0 * identical / n,
        "same_prediction": same,
        "same_prediction_pct": {f: 100.0 * k / n for f, k in same.items()},
        "first_differences": differing,
    }
    if mc:
        row["max_abs_loglikelihood_diff"] = max_diff
    return row


def _prediction(sample: dict, mc: bool):
    if mc:  # the choice with the highest loglikelihood (lm-eval's acc)
        lls = _loglikelihoods(sample)
        return lls.index(max(lls))
    return sample["filtered_resps"]


def _metrics(results: dict, task: str) -> dict[str, float]:
    """A task's scores in lm-eval's results (their stderr left out)."""
    scores = results["results"][task].items()
    return {k: v for k, v in scores if isinstance(v, int | float) and "stderr" not in k}


def compare(run_a: Path, run_b: Path) -> dict:
    (res_a, samples_a), (res_b, samples_b) = load_run(run_a), load_run(run_b)
    tasks = {}
    for task in TASKS:
        row = compare_task(samples_a[task], samples_b[task], mc=task == "mc_local")
        row["metrics"] = {"a": _metrics(res_a, task), "b": _metrics(res_b, task)}
        tasks[task] = row
    result = {"a": str(run_a), "b": str(run_b), "git_sha": git_sha(), "tasks": tasks}
    result["markdown"] = markdown(result)
    return result


def markdown(result: dict) -> str:
    a, b = Path(result["a"]).name, Path(result["b"]).name
    lines = [
        f"# lm-eval, {a} against {b} (git {result['git_sha']})",
        "",
        "| task | documents | identical outputs | same prediction | max abs loglik diff |",
        "| --- | ---: | ---: | --- | ---: |",
    ]
    for task, r in result["tasks"].items():
        diff = r.get("max_abs_loglikelihood_diff")
        same = ", ".join(
            f"{f}: {k} ({r['same_prediction_pct'][f]:.1f}%)"
            for f, k in r["same_prediction"].items()
        )
        lines.append(
            f"| {task} | {r['documents']} | {r['identical']} ({r['identical_pct']:.1f}%) | "
            f"{same} | {'-' if diff is None else f'{diff:.3g}'} |"
        )
    lines += ["", f"| task | metric | {a} | {b} |", "| --- | --- | ---: | ---: |"]
    for task, r in result["tasks"].items():
        for name, value in r["metrics"]["a"].items():
            lines.append(f"| {task} | {name} | {value} | {r['metrics']['b'].get(name)} |")
    return "\n".join(lines) + "\n"


def write(result: dict, json_path: Path | None, md_path: Path | None) -> None:
    if json_path:
        json_path.write_text(json.dumps(result, indent=2, default=str))
    if md_path:
        md_path.write_text(result["markdown"])
    print(result["markdown"], end="")


def pack_wheels(wheel_dir: Path, archive: Path) -> None:
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        sys.exit(f"no wheels in {wheel_dir}")
    with tarfile.open(archive, "w:xz", preset=9) as tar:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                for info in zf.infolist():
                    if info.is_dir():
                        continue
                    data = zf.read(info)
                    member = tarfile.TarInfo(f"{wheel.name}/{info.filename}")
                    member.size, member.mtime = len(data), 0
                    member.mode = (info.external_attr >> 16) & 0o777 or 0o644
                    tar.addfile(member, io.BytesIO(data))
    raw = sum(w.stat().st_size for w in wheels) / 2**20
    size = archive.stat().st_size / 2**20
    print(f"packed {len(wheels)} wheels ({raw:.1f} MiB) into {archive} ({size:.1f} MiB)")


def unpack_wheels(archive: Path, wheel_dir: Path) -> None:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels: dict[str, zipfile.ZipFile] = {}
    try:
        with tarfile.open(archive, "r:xz") as tar:
            for member in tar:
                name, _, inner = member.name.partition("/")
                if not member.isfile() or not name.endswith(".whl") or not inner or ".." in inner:
                    sys.exit(f"{archive}: unexpected member {member.name!r}")
                if name not in wheels:
                    wheels[name] = zipfile.ZipFile(wheel_dir / name, "w", zipfile.ZIP_STORED)
                info = zipfile.ZipInfo(inner, date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = (member.mode & 0o777) << 16
                wheels[name].writestr(info, tar.extractfile(member).read())
    finally:
        for zf in wheels.values():
            zf.close()
    print(f"unpacked {len(wheels)} wheels into {wheel_dir}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="both lm-eval runs, then compare")
    r.add_argument("--model-dir", required=True, help="an HF model directory (config+tokenizer)")
    r.add_argument("--out", required=True, help="a fresh directory for tasks, runs, results")
    r.add_argument("--load-format", default=None, help="dummy: random weights of the config")
    r.add_argument("--dtype", default="auto")
    r.add_argument("--num-test", type=int, default=200, help="documents per local task")
    r.add_argument("--num-fewshot", type=int, default=5, help="gsm8k_local's shots")
    r.add_argument("--max-gen-toks", type=int, default=256, help="gsm8k_local's new tokens")
    r.add_argument("--limit", type=int, default=None, help="lm-eval's --limit (documents)")
    r.add_argument("--backends", default="triton,cuda", help="triton,cuda or one of them")
    r.add_argument("--model-args", default=None, help="more model_args, k=v,k=v")
    c = sub.add_parser("compare", help="two runs' --output_path directories")
    c.add_argument("run_a", type=Path)
    c.add_argument("run_b", type=Path)
    c.add_argument("--json", type=Path, default=None)
    c.add_argument("--md", type=Path, default=None)
    p = sub.add_parser("pack-wheels", help="WHEEL_DIR ARCHIVE.tar.xz")
    p.add_argument("wheel_dir", type=Path)
    p.add_argument("archive", type=Path)
    u = sub.add_parser("unpack-wheels", help="ARCHIVE.tar.xz WHEEL_DIR")
    u.add_argument("archive", type=Path)
    u.add_argument("wheel_dir", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        bad = [b for b in args.backends.split(",") if b not in BACKENDS]
        if bad or not args.backends:
            parser.error(f"--backends: triton and/or cuda, got {args.backends!r}")
        return run(args)
    if args.command == "compare":
        write(compare(args.run_a, args.run_b), args.json, args.md)
    elif args.command == "pack-wheels":
        pack_wheels(args.wheel_dir, args.archive)
    else:
        unpack_wheels(args.archive, args.wheel_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
