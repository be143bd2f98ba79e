"""Instructions per element of the fused AdamW (or Lion) kernel, from SASS compiled for a GPU
target on any machine (no GPU needed): Triton compiles the kernel ahead of time with its bundled
ptxas, and its cuobjdump disassembles it.

    python tools/bench/kernel_sass.py [--formats fp32m,bf16m,q8m,ecc24q8,lion:ecc24q8] [--arch 90]
        [--rows 16] [--warps 8] [--ahead launcher|on|off] [--out DIR]

For each format (AdamW unless prefixed ``lion:``, stochastic rounding on; the names of
``kernel_geometry.py``) it prints the instruction count of the innermost loop (one ``[ROWS, 32]``
tile), that count per element (tile elements over threads), and the opcodes that dominate it;
then the instructions one tile executes on the fast path (:func:`fast_path`): the static count
also holds code that runs only for rare operands (the slow-path calls of IEEE division and
square root, and the ``div_rn`` fallback of the per-chunk reciprocal division), so a change can
add static instructions while the executed ones fall.
The kernels are compiled as a launch on aligned tensors specializes them (pointer arguments
16-byte aligned, ``ALIGNED``). ``--ahead`` picks the kernels' loading one tile ahead (``AHEAD``): as the launcher does
(``ops._loads_ahead``, the default: on for fp32 masters with unblocked moments and for AdamW's
blocked moments over an fp32 or ECC-24 master), or forced on or off. ``--out`` keeps the PTX and
the cubin. The counts are static: how many instructions one tile
issues, not a timing; the GPU's Triton version may emit slightly different code. The kernels
come from the ``memopt_kernels_triton`` on the path, so pointing ``PYTHONPATH`` at another
checkout's ``src`` counts that version.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# (master id, first moment id, second moment id): memopt_core.backends.kernel_master_id/moment_id
FORMATS = {"fp32m": (0, 0, 0), "bf16m": (0, 1, 1), "q8m": (0, 2, 4), "ecc24q8": (3, 2, 4)}
_MOMENT_PTR = {0: "*fp32", 1: "*i16", 2: "*u8", 4: "*u8"}
_INTS = ("n_chunks", "seed", "step", "hstride")


def compile_kernel(
    rule: str, name: str, arch: int, rows: int, warps: int, ahead: bool | None = None
):
    """The ``rule`` (adam or lion) kernel for format ``name`` (stochastic rounding on; Lion's one
    moment takes the first moment's format), compiled for ``arch``; ``ahead`` forces ``AHEAD``
    (None: as the launcher chooses)."""
    if rule == "adam":
        from memopt_kernels_triton.kernels.adam import adam_kernel as kernel
    elif rule == "lion":
        from memopt_kernels_triton.kernels.lion import lion_kernel as kernel
    else:
        raise ValueError(f"rule is adam or lion, got {rule!r}")
    master, f1, f2 = FORMATS[name]
    if rule == "lion":
        f2 = 0
    constexprs = dict(
        MASTER=master, FMT1=f1, FMT2=f2, SR=True, MAXIMIZE=False, HAS_L2=False, HAS_DECAY=True,
        BS=32 if f1 >= 2 or f2 >= 2 else 1, ROWS=rows, HYPER=False, UNSCALE=False, ALIGNED=True,
        ARENA_ALIGNED=True,
    )  # fmt: skip
    # as ops.prepare_step chooses: words when some state rounds, loads ahead where it measured faster
    constexprs["NEED_RAND"] = master in (1, 2, 3) or f1 != 0 or f2 != 0
    if ahead is None:
        from memopt_kernels_triton.ops import _loads_ahead

        ahead = _loads_ahead(rule, constexprs["BS"], master)
    constexprs["AHEAD"] = ahead
    pointers = {
        "chunk_ptr": "*i64",
        "slot_ptr": "*i64",
        "code_ptr": "*u8",
        "m_ptr": _MOMENT_PTR[f1],
        "ms_ptr": "*u8",
        "v_ptr": _MOMENT_PTR[f2],
        "vs_ptr": "*u8",
        "hyper_ptr": "*i32",
    }
    signature, values = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
            values[(i,)] = constexprs[arg]
        else:
            signature[arg] = pointers.get(arg, "i32" if arg in _INTS else "fp32")
    # as a launch specializes them: tensor arguments 16-byte aligned (Triton's divisibility 16)
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names)
             if signature[a].startswith("*")}  # fmt: skip
    src = ASTSource(fn=kernel, signature=signature, constexprs=values, attrs=attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": warps, "enable_fp_fusion": False},
    )


def sass_lines(cubin: Path) -> list[tuple[int, str]]:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    text = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True).stdout
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def _branch_target(text: str) -> int | None:
    m = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
    return int(m.group(1), 16) if m else None


def _loop_bounds(ins: list[tuple[int, str]]) -> tuple[int, int, dict[int, int]]:
    """First and last index of the shortest backward-branch loop (the tile loop), and the index
    of every address."""
    where = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, text) in enumerate(ins):
        if opcode(text) == "BRA":
            target = _branch_target(text)
            if target is not None and target < a and target in where:
                loops.append((where[target], i))
    start, end = min(loops, key=lambda se: se[1] - se[0])
    return start, end, where


def inner_loop(ins: list[tuple[int, str]]) -> list[str]:
    """Opcodes of the shortest backward-branch loop (the tile loop)."""
    start, end, _ = _loop_bounds(ins)
    return [opcode(t) for _, t in ins[start : end + 1]]


_SLOW = ("CALL.REL.NOINC", "FCHK")  # a slow-path subroutine call, or div_rn's range check


def fast_path(ins: list[tuple[int, str]]) -> list[str]:
    """Opcodes one pass through the tile loop executes when every operand takes the fast path:
    a conditional forward branch over code that holds a slow-path call (or a ``div_rn``, whose
    range check ``FCHK`` comes first) is taken, every other one falls through (a masked load,
    for instance, runs), and unconditional jumps are followed."""
    start, end, where = _loop_bounds(ins)
    out, i = [], start
    while i <= end:
        text = ins[i][1]
        op = opcode(text)
        out.append(op)
        if op == "BRA" and i != end:
            target = where[_branch_target(text)]
            skipped = {opcode(t) for _, t in ins[i + 1 : target]}
            if not text.startswith("@") or (target > i and skipped & set(_SLOW)):
                i = target
                continue
        i += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default=",".join(FORMATS), help="[lion:]format list")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (%(default)s)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--ahead", choices=["launcher", "on", "off"], default="launcher")
    ap.add_argument("--out", type=Path, default=Path("out/sass"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    per_thread = args.rows * 32 / (args.warps * 32)
    for item in args.formats.split(","):
        rule, _, name = item.rpartition(":")
        rule = rule or "adam"
        ahead = {"launcher": None, "on": True, "off": False}[args.ahead]
        k = compile_kernel(rule, name, args.arch, args.rows, args.warps, ahead)
        label = name if rule == "adam" else f"{rule}:{name}"
        stem = label.replace(":", "_")
        (args.out / f"{stem}.ptx").write_text(k.asm["ptx"])
        cubin = args.out / f"{stem}.cubin"
        cubin.write_bytes(k.asm["cubin"])
        ins = sass_lines(cubin)
        body = inner_loop(ins)
        top = ", ".join(f"{op} {n}" for op, n in collections.Counter(body).most_common(8))
        fast = len(fast_path(ins))
        print(f"{label:13s} tile loop {len(body):4d} instructions, "
              f"{len(body) / per_thread:6.1f} per element ({per_thread:g} per thread); {top}")  # fmt: skip
        print(f"{'':13s} fast path {fast:4d} executed, {fast / per_thread:6.1f} per element")


if __name__ == "__main__":
    main()
