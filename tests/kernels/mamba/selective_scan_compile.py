"""Compile Mamba1's selective-scan kernels for an H100/H200 (sm_90) without a GPU, and report
what the interpreter cannot show: whether every variant compiles (Triton's type rules are
stricter than the interpreter's), and the scan loop's layout cost, counted in the PTX:
shuffles and barriers (a state tile spread over lanes along dstate pays both on every
token), and ex2 instructions (the SFU work per token and channel); in the SASS, the scan
loop's instructions (UNROLL tokens per trip), its global loads and how many of them issue
before the first instruction that waits on one (``ldg_ahead``: the loads in flight at a
warp's first stall), and the kernel's registers and stack (spills) from cuobjdump.

Run as ``python -m tests.kernels.mamba.selective_scan_compile`` with TRITON_INTERPRET unset
(the kernels must be JIT functions); it prints one JSON line per variant. A helper of
test_selective_scan_compile.py, and the first look at a kernel change before the GPU box.
"""

from __future__ import annotations

import collections
import json
import os
import re

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("run with TRITON_INTERPRET unset: the kernels must be JIT functions")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from benchmarks.kernels.sm90_compile import run_tool, sass_loops  # noqa: E402
from vllm.model_executor.layers.mamba.ops import selective_scan_kernels as K  # noqa: E402

# bf16 activations; B and C reach the prefill scan in fp32 (the op converts them), the
# decode update reads them as given.
ACTIVATIONS = ("u_ptr", "delta_ptr", "z_ptr", "out_ptr")
# Integer arguments equal to 1 in the layer's launches (unit strides along dstate and dim):
# Triton compiles them in as the constant 1 unless the kernel marks them do_not_specialize.
UNIT = ("stride_A_n", "stride_state_n", "stride_u_d", "stride_delta_d", "stride_z_d",
        "stride_B_n", "stride_C_n", "stride_D_d", "stride_bias_d", "stride_idx_b",
        "stride_out_d")  # fmt: skip
FLAGS = ("HAS_D", "HAS_Z", "HAS_BIAS", "SOFTPLUS", "HAS_INDICES")


def compile_sm90(kernel, constexprs: dict, num_warps: int, pool: str = "fp32"):
    """The kernel compiled for sm_90 as a falcon-mamba-7b layer's launch compiles it: bf16
    activations, int32 indices, a ``pool`` state pool, 16-byte aligned pointers, the UNIT
    strides as the constant 1 and the other integers as multiples of 16 (dim 8192, dstate
    16, row strides 2 x 8192 and 288) where Triton would specialise them."""
    bc = "bf16" if kernel is K._selective_state_update_mamba1_kernel else "fp32"
    names = kernel.arg_names
    plain = {p.name for p in kernel.params if p.do_not_specialize}
    constexprs = dict(constexprs, **{n: 1 for n in UNIT if n in names and n not in plain})
    sig, ptrs, sixteens = {}, [], []
    for name in names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            ptrs.append(name)
            if name in ACTIVATIONS:
                sig[name] = "*bf16"
            elif name in ("B_ptr", "C_ptr"):
                sig[name] = f"*{bc}"
            elif name in ("qsl_ptr", "idx_ptr"):
                sig[name] = "*i32"
            elif name == "init_ptr":
                sig[name] = "*i1"
            elif name == "state_ptr":
                sig[name] = f"*{pool}"
            else:
                sig[name] = "*fp32"
        else:
            sig[name] = "i32"
            if name not in plain:
                sixteens.append(name)
    src = ASTSource(
        fn=kernel,
        signature=sig,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in ptrs + sixteens},
    )
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(src, target=target, options=dict(num_warps=num_warps, num_stages=1))


def ptx_counts(ptx: str) -> dict:
    return {
        "ex2": len(re.findall(r"\bex2\.approx", ptx)),
        "shfl": len(re.findall(r"\bshfl\.", ptx)),
        "bar": len(re.findall(r"\bbar\.sync|\bbarrier\.sync", ptx)),
    }


def resources(cubin: bytes) -> dict:
    """Registers per thread and stack bytes (spills) of the kernel, from cuobjdump."""
    text = run_tool("cuobjdump", cubin, "--dump-resource-usage")
    if text is None:
        return {}
    regs, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    return {"regs": int(regs.group(1)), "stack": int(stack.group(1))}


_REG = re.compile(r"\bR(\d+)\b")


def _loads_ahead(body: list[str]) -> tuple[int, int]:
    """(global loads in a loop body, those issued before the first instruction that reads a
    register one of them loaded): how many loads a warp has in flight at its first stall."""
    pending: set[int] = set()
    total = ahead = 0
    stalled = False
    for ln in body:
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)(\.[A-Z0-9.]*)?\s+([^;]*)", ln)
        if not m:
            continue
        op, mods, operands = m.group(1), m.group(2) or "", m.group(3)
        dest, _, srcs = operands.partition(",")
        if op.startswith("ST"):
            dest, srcs = "", operands
        if not stalled and pending & {int(r) for r in _REG.findall(srcs)}:
            stalled = True
        if op == "LDG":
            total += 1
            ahead += not stalled
            width = {".64": 2, ".128": 4}.get(
                next((w for w in (".128", ".64") if w in mods), ""), 1
            )
            base = int(_REG.search(dest).group(1))
            pending.update(range(base, base + width))
    return total, ahead


def loop_sass(cubin: bytes) -> dict:
    """Instruction counts of the largest loop with an SFU instruction in the SASS (the scan
    loop: UNROLL tokens per trip), by opcode family, from the nvdisasm Triton ships; and
    its global loads, all of them and those issued before the first use of one."""
    lines, loops = sass_loops(cubin)
    if not lines:
        return {}
    best: collections.Counter = collections.Counter()
    body: list[str] = []
    for ops, region in loops:
        if ops["MUFU"] and sum(ops.values()) > sum(best.values()):
            best, body = ops, region
    ldg, ahead = _loads_ahead(body)
    return {"loop_instrs": sum(best.values()), "loop_mufu": best["MUFU"],
            "loop_fp32": best["FMUL"] + best["FFMA"] + best["FADD"], "loop_ldg": ldg,
            "ldg_ahead": ahead}  # fmt: skip


def variants() -> list[tuple[str, object, dict, int, str]]:
    """(name, kernel, constexprs, num_warps, pool dtype). The prefill scan's variants cover
    default.json's launches (1: plain, 3: PREFETCH) and the latency knobs the tuner sweeps
    (benchmarks/kernels/tune_selective_scan.py), UNROLL 4 with PREFETCH excepted: it
    spills (255 registers and a stack with Triton 3.6)."""
    on = dict.fromkeys(FLAGS, True)
    off = dict.fromkeys(FLAGS, False)
    tile = dict(BLOCK_D=64, BLOCK_N=16)
    out = []
    chunk = K._selective_scan_chunk_kernel
    for final, prefetch, unroll in ((False, False, 1), (True, False, 1), (True, True, 1),
                                    (False, True, 1), (False, False, 2), (True, False, 2),
                                    (True, True, 2), (True, False, 4)):  # fmt: skip
        name = f"chunk final={final}" + (" prefetch" if prefetch else "")
        name += f" unroll={unroll}" if unroll > 1 else ""
        full = dict(on, HAS_INIT=True, FINAL=final, PREFETCH=prefetch, UNROLL=unroll, **tile)
        out.append((name, chunk, full, 2, "fp32"))
    bare = dict(off, HAS_INIT=False, FINAL=False, PREFETCH=True, UNROLL=2, **tile)
    out.append(("chunk bare bf16-pool", chunk, bare, 2, "bf16"))
    out.append(("state passing", K._selective_scan_state_passing_kernel,
                dict(HAS_INDICES=True, BLOCK_D=32, BLOCK_N=16), 1, "bf16"))  # fmt: skip
    out.append(("update", K._selective_state_update_mamba1_kernel, dict(on, **tile), 2, "fp32"))
    out.append(("update bare", K._selective_state_update_mamba1_kernel, dict(off, **tile), 2,
                "bf16"))  # fmt: skip
    return out


def main() -> None:
    for name, kernel, constexprs, warps, pool in variants():
        compiled = compile_sm90(kernel, constexprs, warps, pool)
        layouts = re.findall(r"#ttg\.blocked<\{[^}]*\}>", compiled.asm["ttgir"])
        cubin = compiled.asm["cubin"]
        print(json.dumps(dict(variant=name, unroll=constexprs.get("UNROLL", 1),
                              layouts=sorted(set(layouts)), **ptx_counts(compiled.asm["ptx"]),
                              **loop_sass(cubin), **resources(cubin))))  # fmt: skip


if __name__ == "__main__":
    main()
