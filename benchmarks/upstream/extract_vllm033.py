"""Build the package ``upstream_vllm033`` (upstream vLLM 0.33.0's Triton kernels, the
benchmarks' reference) from the vllm 0.33.0 wheel, into a git-ignored folder.

    python -m benchmarks.upstream.extract_vllm033 vllm-0.33.0-*.whl [--out .upstream]

It writes ``OUT/upstream_vllm033/``, never to be committed (upstream's code under its own
licence, only extracted at build time; docs/gpu_box.md "What to carry"):

- ``ops/``: the modules of the wheel's ``vllm/model_executor/layers/mamba/ops/`` that
  ``OPS_ENTRIES`` import, followed through their imports of each other, and
  ``configs/selective_state_update/`` (their launch tables);
- ``fused_moe/fused_moe.py``: only the top-level definitions of the wheel's
  ``vllm/model_executor/layers/fused_moe/fused_moe.py`` named in ``MOE_NAMES``, with what
  they use of that module (found with ``ast``), and ``fused_moe/configs/``: the wheel's
  launch tables (every device's) of the fused-MoE benchmark's shapes;
- ``shims.py``: a copy of benchmarks/upstream/vllm033_shims.py. Every ``vllm.*`` import of
  the extracted code is rewritten, one import statement at a time with a regular
  expression, either to a sibling module (``from .ssd_bmm import ...``) or to a name of the
  shims that ``SHIMS`` / ``IMPORT_AS`` list. An import that neither covers stops the
  extraction with the file and the statement; so does a use of a shim object's attribute
  that the shims lack (``envs.X``, ``current_platform.x``);
- ``__init__.py`` files and ``README.txt`` (what made it, from which wheel).

Then it imports the result in a fresh process (``--no-check`` skips that).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import re
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "upstream_vllm033"
VERSION = "0.33.0"
OPS_PKG = "vllm.model_executor.layers.mamba.ops"
OPS_DIR = OPS_PKG.replace(".", "/")
OPS_CONFIGS = f"{OPS_DIR}/configs/selective_state_update/"
# What the benchmarks import (benchmarks/kernels/ssd_bench_providers.py,
# benchmark_replayssm.py, ssd_compile_compare.py); their own imports are followed.
OPS_ENTRIES = ("ssd_combined", "mamba_ssm", "selective_state_update_replayssm_output_only")
MOE_FILE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
MOE_CONFIGS = "vllm/model_executor/layers/fused_moe/configs/"
# What benchmarks/kernels/benchmark_fused_moe.py and moe_compile_report.py use of it.
MOE_NAMES = ("fused_moe_kernel", "write_zeros_to_output", "invoke_fused_moe_triton_kernel",
             "get_config_file_name", "get_moe_configs", "get_default_config", "tl")  # fmt: skip
MOE_BENCH = REPO / "benchmarks" / "kernels" / "benchmark_fused_moe.py"
SHIMS_SOURCE = Path(__file__).with_name("vllm033_shims.py")
SHIM_MODULE = "..shims"  # as the modules of ops/ and fused_moe/ import it


def _same(*names: str) -> dict[str, str]:
    return {name: name for name in names}


# upstream module -> {name it exports: the shims' name for it}
SHIMS = {
    "vllm": {"_custom_ops": "custom_ops", "envs": "envs"},
    "vllm._xpu_ops": _same("xpu_ops"),
    "vllm.platforms": _same("current_platform"),
    "vllm.triton_utils": _same("tl", "triton", "HAS_TRITON"),
    "vllm.triton_utils.allocation": _same("set_triton_allocator"),
    "vllm.logger": _same("init_logger"),
    "vllm.utils.platform_utils": _same("get_device_name_as_file_name"),
    "vllm.utils.math_utils": _same("next_power_of_2"),
    "vllm.v1.attention.backends.utils": _same("NULL_BLOCK_ID", "PAD_SLOT_ID"),
    "vllm.model_executor.layers.fused_moe.utils": _same(
        "enable_swap_ab", "resolve_moe_use_td", "warn_if_moe_use_td_ineffective"
    ),
    f"{OPS_PKG}.cpu.mamba_ssm": {"selective_state_update": "cpu_selective_state_update"},
}
# ``import <upstream module> as alias`` -> the shims' name bound to alias
IMPORT_AS = {"vllm.envs": "envs", f"{OPS_PKG}.cpu.mamba_ssm": "cpu_mamba_ssm"}

FROM_RE = re.compile(
    r"(?P<indent>[ \t]*)from[ \t]+(?P<module>\.*[\w.]*)[ \t]+import[ \t]+"
    r"(?P<names>\([^)]*\)|[^\n#()]*[^\s#()])(?P<comment>[ \t]*#[^\n]*)?",
)
IMPORT_RE = re.compile(
    r"(?P<indent>[ \t]*)import[ \t]+(?P<names>[^\n#]*[^\s#])(?P<comment>[ \t]*#[^\n]*)?"
)
ALIAS_RE = re.compile(r"(?P<name>[\w.]+)(?:\s+as\s+(?P<alias>\w+))?")


class ExtractError(RuntimeError):
    """The wheel holds something the extractor does not handle (it names what)."""


def _aliases(names: str, where: str) -> list[tuple[str, str | None]]:
    """[(name, alias or None)] of an import's name list (parentheses and comments allowed)."""
    body = re.sub(r"#[^\n]*", "", names).strip().removeprefix("(").removesuffix(")")
    out = []
    for part in filter(None, (p.strip() for p in body.split(","))):
        m = ALIAS_RE.fullmatch(part)
        if not m:
            raise ExtractError(f"{where}: cannot read the imported name {part!r}")
        out.append((m["name"], m["alias"]))
    return out


def _shim_line(indent: str, pairs: list[tuple[str, str]], comment: str | None) -> str:
    names = ", ".join(shim if shim == bound else f"{shim} as {bound}" for shim, bound in pairs)
    return f"{indent}from {SHIM_MODULE} import {names}{comment or ''}"


def rewrite_statement(seg: str, where: str, local_pkg: str | None):
    """(new text or None if unchanged, [sibling modules it imports], {bound name: shim})."""
    if m := FROM_RE.fullmatch(seg):
        module, names = m["module"], m["names"]
        if module.startswith("."):
            if local_pkg and re.fullmatch(r"\.\w+", module):
                return None, [module[1:]], {}
            raise ExtractError(f"{where}: unhandled relative import: {seg.strip()}")
        if module in SHIMS:
            pairs, bound = [], {}
            for name, alias in _aliases(names, where):
                if name not in SHIMS[module]:
                    raise ExtractError(f"{where}: unhandled import of {name}: {seg.strip()}")
                pairs.append((SHIMS[module][name], alias or name))
                bound[alias or name] = SHIMS[module][name]
            return _shim_line(m["indent"], pairs, m["comment"]), [], bound
        rest = module.removeprefix(f"{local_pkg}.") if local_pkg else module
        if local_pkg and rest != module and re.fullmatch(r"\w+", rest):
            return f"{m['indent']}from .{rest} import {names}{m['comment'] or ''}", [rest], {}
        if module.split(".")[0] == "vllm":
            raise ExtractError(f"{where}: unhandled import: {seg.strip()}")
        return None, [], {}
    if m := IMPORT_RE.fullmatch(seg):
        pairs = _aliases(m["names"], where)
        if not any(name.split(".")[0] == "vllm" for name, _ in pairs):
            return None, [], {}
        if len(pairs) == 1 and pairs[0][0] in IMPORT_AS and pairs[0][1]:
            (name, alias), shim = pairs[0], IMPORT_AS[pairs[0][0]]
            return _shim_line(m["indent"], [(shim, alias)], m["comment"]), [], {alias: shim}
        raise ExtractError(f"{where}: unhandled import: {seg.strip()}")
    if "vllm" in seg:
        raise ExtractError(f"{where}: cannot read the import statement: {seg.strip()}")
    return None, [], {}


def rewrite_imports(text: str, where: str, local_pkg: str | None = None):
    """(text with its vllm imports redirected, [sibling modules it imports]). Lines are
    kept where they were (a shorter statement is followed by blank lines)."""
    tree = ast.parse(text, where)
    lines = text.splitlines(keepends=True)
    edits, local, bound = [], [], {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        seg = "".join(lines[node.lineno - 1 : node.end_lineno]).rstrip("\n")
        new, mods, names = rewrite_statement(seg, f"{where}:{node.lineno}", local_pkg)
        local += mods
        bound.update(names)
        if new is not None:
            edits.append((node.lineno, node.end_lineno, new))
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1 : end] = [new + "\n" * (1 + end - start - new.count("\n"))]
    out = "".join(lines)
    _check_rewritten(out, where, bound)
    return out, sorted(set(local))


def _shims_module() -> types.ModuleType:
    from benchmarks.upstream import vllm033_shims

    return vllm033_shims


def _check_rewritten(text: str, where: str, bound: dict[str, str]) -> None:
    """No vllm import is left; every ``alias.attr`` of a shim object exists in the shims
    (Triton's own modules only warn: a name missing there fails only where it is used)."""
    shims = _shims_module()
    for node in ast.walk(ast.parse(text, where)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(n.split(".")[0] == "vllm" for n in names):
                raise ExtractError(f"{where}:{node.lineno}: a vllm import is left")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in bound):  # fmt: skip
            obj = getattr(shims, bound[node.value.id])
            if isinstance(obj, shims.Unavailable) or hasattr(obj, node.attr):
                continue
            msg = f"{where}:{node.lineno}: the shims' {bound[node.value.id]} lacks {node.attr}"
            if not isinstance(obj, types.ModuleType):
                raise ExtractError(msg)
            print(f"warning: {msg}", file=sys.stderr)


def _read(wheel: zipfile.ZipFile, name: str, why: str) -> str:
    try:
        return wheel.read(name).decode()
    except KeyError:
        raise ExtractError(f"{name} ({why}) is not in {wheel.filename}") from None


def extract_ops(wheel: zipfile.ZipFile, dest: Path, entries=OPS_ENTRIES) -> list[str]:
    """Write ``dest`` (the ops package): the entry modules and the sibling modules they
    import, rewritten, and the launch tables. Returns the module names written."""
    dest.mkdir(parents=True)
    todo, done = [(name, "an entry point") for name in entries], {}
    while todo:
        name, why = todo.pop()
        if name in done:
            continue
        path = f"{OPS_DIR}/{name}.py"
        done[name], local = rewrite_imports(_read(wheel, path, why), path, OPS_PKG)
        todo += [(m, f"imported by {name}.py") for m in local]
    for name, text in done.items():
        (dest / f"{name}.py").write_text(text)
    (dest / "__init__.py").write_text(f'"""{OPS_PKG} of vllm {VERSION} (extracted)."""\n')
    for info in wheel.infolist():
        if info.filename.startswith(OPS_CONFIGS) and not info.is_dir():
            target = dest / info.filename.removeprefix(f"{OPS_DIR}/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(wheel.read(info))
    return sorted(done)


def cut_module(text: str, wanted, where: str) -> str:
    """The source of the top-level definitions ``wanted`` and of what they use of the
    module (its definitions and assignments, its imports cut down to the names used), in
    the module's order."""
    tree = ast.parse(text, where)
    lines = text.splitlines(keepends=True)
    defs, imports = {}, {}
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defs[stmt.name] = stmt
        elif isinstance(stmt, ast.Assign | ast.AnnAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        defs[n.id] = stmt
        elif isinstance(stmt, ast.Import | ast.ImportFrom):
            for a in stmt.names:
                imports[a.asname or a.name.split(".")[0]] = (stmt, a)
    kept, used, todo = set(), {}, list(wanted)
    while todo:
        name = todo.pop()
        if name in imports:
            stmt, alias = imports[name]
            used.setdefault(id(stmt), (stmt, []))
            if alias not in used[id(stmt)][1]:
                used[id(stmt)][1].append(alias)
        elif name in defs:
            if id(defs[name]) not in kept:
                kept.add(id(defs[name]))
                todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name)]
        elif name in wanted:
            raise ExtractError(f"{where}: {name} is not a top-level name")
    out = []
    for stmt in tree.body:
        if id(stmt) in used:
            names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "")
                              for a in stmt.names if a in used[id(stmt)][1])  # fmt: skip
            if isinstance(stmt, ast.ImportFrom):
                out.append(f"from {'.' * stmt.level}{stmt.module or ''} import {names}\n")
            else:
                out.append(f"import {names}\n")
        elif id(stmt) in kept:
            first = min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])
            out.append("\n\n" + "".join(lines[first - 1 : stmt.end_lineno]))
    return "".join(out)


def moe_shapes(bench: Path = MOE_BENCH) -> list[tuple[int, int]]:
    """(experts, intermediate) of the fused-MoE benchmark's SHAPES, read from its source."""
    for node in ast.parse(bench.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "SHAPES" for t in node.targets
        ):
            return sorted({(v[1], v[2]) for v in ast.literal_eval(node.value).values()})
    raise ExtractError(f"{bench}: no SHAPES")


def extract_moe(wheel: zipfile.ZipFile, dest: Path, shapes, names=MOE_NAMES) -> list[str]:
    """Write ``dest`` (the fused_moe package). Returns the launch tables copied."""
    dest.mkdir(parents=True)
    source = _read(wheel, MOE_FILE, "the fused-MoE kernel")
    cut = cut_module(source, names, MOE_FILE)
    licence = re.match(r"(#[^\n]*\n)*", source)[0]  # upstream's SPDX lines, kept
    head = f'{licence}"""The parts of vllm {VERSION}\'s {MOE_FILE} that the fused-MoE benchmark '
    head += 'calls,\ncut out by benchmarks/upstream/extract_vllm033.py."""\n\n'
    text, _ = rewrite_imports(head + cut, f"{MOE_FILE} (cut)")
    (dest / "fused_moe.py").write_text(text)
    (dest / "__init__.py").write_text(f'"""Parts of vllm {VERSION}\'s fused MoE."""\n')
    prefixes = tuple(f"{MOE_CONFIGS}E={e},N={n},device_name=" for e, n in shapes)
    copied = []
    for info in wheel.infolist():
        if info.filename.startswith(prefixes):
            name = info.filename.removeprefix(MOE_CONFIGS)
            (dest / "configs").mkdir(exist_ok=True)
            (dest / "configs" / name).write_bytes(wheel.read(info))
            copied.append(name)
    return sorted(copied)


def wheel_version(wheel: zipfile.ZipFile) -> str | None:
    for name in wheel.namelist():
        if re.fullmatch(r"vllm-[^/]+\.dist-info/METADATA", name):
            m = re.search(r"^Version: (\S+)", wheel.read(name).decode(), re.M)
            return m[1] if m else None
    return None


def check_import(out: Path, modules: list[str]) -> None:
    """Import the extracted modules in a fresh process with ``out`` on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(out),
               os.environ.get("PYTHONPATH")])))  # fmt: skip
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    done = subprocess.run([sys.executable, "-c", code, *modules], env=env, cwd=out,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise ExtractError(f"the extracted package does not import:\n{done.stderr[-3000:]}")


def extract(wheel_path: Path, out: Path, ops_entries=OPS_ENTRIES, moe_names=MOE_NAMES,
            shapes=None, check: bool = True) -> dict:  # fmt: skip
    """Build ``out/upstream_vllm033`` from the wheel (replacing any earlier one)."""
    wheel_path, out = Path(wheel_path).resolve(), Path(out).resolve()
    with zipfile.ZipFile(wheel_path) as wheel:
        if (version := wheel_version(wheel)) != VERSION:
            raise ExtractError(f"{wheel_path.name} is vllm {version}, not {VERSION}")
        tmp = out / f".{PACKAGE}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            (tmp / "__init__.py").write_text(
                f'"""vllm {VERSION}\'s Triton kernels (extracted)."""\n'
            )
            shutil.copyfile(SHIMS_SOURCE, tmp / "shims.py")
            ops = extract_ops(wheel, tmp / "ops", ops_entries) if ops_entries else []
            tables = []
            if moe_names:
                tables = extract_moe(wheel, tmp / "fused_moe", shapes or moe_shapes(), moe_names)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # an earlier package, if any, stays
            raise
    digest = hashlib.sha256(wheel_path.read_bytes()).hexdigest()
    (tmp / "README.txt").write_text(
        f"Generated by `python -m benchmarks.upstream.extract_vllm033` (this repository)\n"
        f"from {wheel_path.name} (sha256 {digest}).\n"
        "Upstream vLLM's code, extracted at build time: NEVER commit this folder.\n"
        "Rebuild it with the command above, or `bash scripts/make_carry.sh --only upstream`.\n\n"
        f"ops/: {', '.join(ops) or '-'}\nfused_moe/configs/: {', '.join(tables) or '-'}\n"
    )
    final = out / PACKAGE
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    modules = [f"{PACKAGE}.ops.{m}" for m in ops]
    modules += [f"{PACKAGE}.fused_moe.fused_moe"] if moe_names else []
    if check:
        check_import(out, modules)
    return {"package": str(final), "ops": ops, "moe_tables": tables, "modules": modules}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheel", type=Path, help=f"vllm-{VERSION}-*.whl")
    out_help = "the folder to put on PYTHONPATH (default: the repository's .upstream)"
    p.add_argument("--out", type=Path, default=REPO / ".upstream", help=out_help)
    p.add_argument("--no-check", action="store_true", help="do not import the result")
    args = p.parse_args(argv)
    try:
        res = extract(args.wheel, args.out, check=not args.no_check)
    except ExtractError as err:
        print(f"extract_vllm033: {err}", file=sys.stderr)
        return 1
    print(f"wrote {res['package']}: ops {', '.join(res['ops'])}")
    print(f"fused_moe tables: {', '.join(res['moe_tables']) or 'none'}")
    h200 = [t for t in res["moe_tables"] if t.endswith("device_name=NVIDIA_H200.json")]
    print(
        f"  bf16 ones for NVIDIA_H200 (no dtype in the name): {', '.join(h200) or 'none'}"
        + ("" if h200 else ": on an H200 upstream takes get_default_config's pick")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
