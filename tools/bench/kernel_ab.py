"""A/B of the fused Adam and Lion kernels on a GPU: the working tree's kernels against those of a
git revision, in one process, so that both sides see the same GPU state.

    python tools/bench/kernel_ab.py [--baseline HEAD~1 | DIR] [--rounds 3] [--out ab.json]

The baseline's ``kernels/adam.py`` and ``kernels/lion.py`` are read with ``git show`` (or from
folder ``DIR``, for a host whose copy of the tree has no git history) and loaded as modules
beside the installed package (they import its codecs, tiles and random words, so a change to
those shared modules shows on both sides). A shared module the installed package no longer has
(``kernels/philox.py``, before KERNEL_API 3's ``kernels/rng.py``) is loaded from the baseline
too. With stochastic rounding on (every case here), a baseline from before KERNEL_API 3 draws
other random words, so its ``same_bits`` is False by design: compare the timings only. For each case (rule, state format, geometries) and
profile (8 x 64M, 4096 x 32K) the tool first runs one launch of each side from the same state and
compares every output bit (``same_bits``), then times prepared launches in ``--rounds``
interleaved rounds (median of 11 launches between CUDA events per round; the row's ``ms`` is the
median over rounds). Constexprs the baseline does not declare (e.g. ``AHEAD``) are dropped for it.
``--cases adam:bf16m,lion:ecc24q8`` runs a subset; ``--launcher-geometry`` times each case at the
launcher's default configuration (``ops.kernel_config``: geometry and register cap) instead of
the geometries listed here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from apexw_kernel_probe import events_ms
from kernel_geometry import group_work

from memopt_core.backends import GroupStep

_KERNEL_FILES = {"adam": "adam", "lion": "lion"}  # rule -> module under kernels/
_PACKAGE_DIR = "packages/memopt-kernels-triton/src/memopt_kernels_triton/kernels"
CASES = [  # (rule, format, geometries (rows, warps)); the first geometry also checks bits
    ("adam", "bf16m", [(16, 8), (32, 8)]),
    ("adam", "fp32m", [(16, 8), (32, 8)]),
    ("adam", "q8m", [(8, 4)]),
    ("adam", "ecc24q8", [(8, 4)]),
    ("adam", "ecc24bf16", [(16, 8), (32, 8)]),
    ("lion", "bf16m", [(16, 8), (32, 8)]),
    ("lion", "ecc24q8", [(8, 4)]),
]
PROFILES = [(8, 64 * 2**20), (4096, 32 * 2**10)]


class _Declared:
    """A baseline kernel launched without the constexprs (upper-case names, by this package's
    convention) that its signature does not declare; launch options (``num_warps``,
    ``enable_fp_fusion``, ...) pass through."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.names = set(kernel.arg_names)

    def __getitem__(self, grid):
        def run(*args, **kw):
            kw = {k: v for k, v in kw.items() if k in self.names or not k.isupper()}
            return self.kernel[grid](*args, **kw)

        return run


_SHARED_IMPORT = re.compile(r"^from memopt_kernels_triton\.kernels\.(\w+) import", re.M)


def _read(rev: str, root: Path, name: str) -> str:
    """Module ``name`` of ``kernels/`` at revision ``rev`` (or in folder ``rev``)."""
    if Path(rev).is_dir():
        return (Path(rev) / f"{name}.py").read_text()
    return subprocess.run(
        ["git", "show", f"{rev}:{_PACKAGE_DIR}/{name}.py"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def _load(src: str, name: str, tmp: Path):
    path = tmp / f"baseline_{name}.py"
    path.write_text(src)  # Triton's jit reads a kernel's source from its file
    spec = importlib.util.spec_from_file_location(f"baseline_{name}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _with_missing_modules(src: str, rev: str, root: Path, tmp: Path) -> str:
    """``src`` importing the baseline's own copy of each shared ``kernels`` module the installed
    package lacks (renamed or removed since ``rev``), loaded as ``baseline_<name>``."""
    for name in sorted(set(_SHARED_IMPORT.findall(src))):
        if importlib.util.find_spec(f"memopt_kernels_triton.kernels.{name}") is not None:
            continue
        if not (tmp / f"baseline_{name}.py").exists():  # once per baseline
            _load(_with_missing_modules(_read(rev, root, name), rev, root, tmp), name, tmp)
        src = src.replace(
            f"from memopt_kernels_triton.kernels.{name} import", f"from baseline_{name} import"
        )
    return src


def load_baseline(rev: str, root: Path) -> dict[str, _Declared]:
    """``{rule: kernel}`` of revision ``rev``'s kernel modules (or of folder ``rev``'s copies)."""
    out = {}
    tmp = Path(tempfile.mkdtemp(prefix="kernel_ab_"))
    for rule, name in _KERNEL_FILES.items():
        src = _with_missing_modules(_read(rev, root, name), rev, root, tmp)
        module = _load(src, name, tmp)
        out[rule] = _Declared(getattr(module, f"{rule}_kernel"))
    return out


def _state(work: GroupStep) -> list[torch.Tensor]:
    out = list(work.params)
    for fields in work.arena.fields.values():
        out += list(fields.values())
    if work.arena.master_code is not None:
        out.append(work.arena.master_code)
    return out


def main() -> None:
    from memopt_kernels_triton import ops

    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="HEAD~1", help="git revision or folder (%(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=None, help="rule:format list (default: all)")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--launcher-geometry", action="store_true", help="time at the launcher's default config"
    )
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[2]
    sides = (load_baseline(args.baseline, root), dict(ops._KERNELS))
    labels = (args.baseline, "tree")
    rows = []
    wanted = None if args.cases is None else set(args.cases.split(","))
    for rule, name, geos in CASES:
        if wanted is not None and f"{rule}:{name}" not in wanted:
            continue
        for n, numel in PROFILES:
            work = group_work(name, n, numel, rule)
            configs = [ops.KernelConfig(rows=r, num_warps=w) for r, w in geos]
            if args.launcher_geometry:
                ops.reset_kernel_config()
                dtype = work.plan.param_dtype
                mid = ops.master_id(work.spec.master_for(dtype).name, dtype)
                configs = [
                    ops.kernel_config(blocked=work.plan.block_size == 32, rule=rule, master=mid)
                ]
            start = [t.clone() for t in _state(work)]
            ends = []
            for side in sides:
                for t, s in zip(_state(work), start, strict=True):
                    t.copy_(s)
                ops._KERNELS[rule] = side[rule]
                ops.prepare_step(work, configs[0]).launch(work.scalars, 10, 0, False)
                torch.cuda.synchronize()
                ends.append([t.clone() for t in _state(work)])
            same = all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(*ends, strict=True)
            )
            del start, ends
            times: dict[tuple[int, int], list[float]] = {}
            for _ in range(args.rounds):
                for i, side in enumerate(sides):
                    ops._KERNELS[rule] = side[rule]
                    for j, config in enumerate(configs):
                        p = ops.prepare_step(work, config)
                        ms = events_ms(lambda p=p, s=work.scalars: p.launch(s, 10, 0, False), 11)
                        times.setdefault((i, j), []).append(ms)
            ops.reset_kernel_config()
            for (i, j), ms in times.items():
                r, w, cap = configs[j].rows, configs[j].num_warps, configs[j].maxnreg
                row = {
                    "rule": rule, "format": name, "tensors": n, "numel": numel,
                    "kernels": labels[i], "rows": r, "warps": w, "maxnreg": cap,
                    "ms": round(statistics.median(ms), 4), "rounds": [round(x, 4) for x in ms],
                    "same_bits": same,
                }  # fmt: skip
                rows.append(row)
                print(
                    f"{rule:4s} {name:8s} {n:5d} x {numel:9d} {labels[i]:>10s} {r:2d}x{w}: "
                    f"{row['ms']:7.3f} ms  same bits: {same}",
                    flush=True,
                )
            del work
            torch.cuda.empty_cache()
    ops._KERNELS.update(sides[1])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
