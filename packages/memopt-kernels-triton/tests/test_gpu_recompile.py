"""GPU: new learning rates and weight decays between steps, and the step count advancing, reuse
the compiled rule kernel (they are runtime arguments, not compile-time ones), through the fused
step and through a prepared step; the results stay the torch backend's bits, so the new values
were used. The compiled variants are counted in the Triton JIT function's per-device cache."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from memopt_core.formats import StateSpec
from memopt_core.testing import VARIANTS, diff_report, group_step, make_grads, make_group
from memopt_core.torch_backend import TorchBackend

TORCH = TorchBackend()
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0")


def compiled_variants(kernel) -> int:
    """How many variants of Triton JIT function ``kernel`` this process has compiled, over all
    devices. Triton 3.x keeps them in ``kernel.device_caches``: device -> a tuple whose first
    item is the dict {specialization key: compiled kernel} (then, depending on the release, a
    key cache, the target, the backend, the binder); releases before it in ``kernel.cache``:
    device -> that dict. Any other layout fails the test, naming what was found."""
    caches = getattr(kernel, "device_caches", None)
    where = "device_caches"
    if caches is None:
        caches, where = getattr(kernel, "cache", None), "cache"
    if not isinstance(caches, dict):
        pytest.fail(
            f"{kernel!r} ({type(kernel).__name__}) has neither a dict 'device_caches' nor a dict "
            "'cache' of compiled kernels: update compiled_variants for this Triton"
        )
    total = 0
    for device, entry in list(caches.items()):  # a defaultdict: never index it
        kernels = entry[0] if isinstance(entry, (tuple, list)) and entry else entry
        if not isinstance(kernels, dict):
            pytest.fail(
                f"{kernel!r}.{where}[{device!r}] is a {type(entry).__name__} without the dict of "
                "compiled kernels (first item): update compiled_variants for this Triton"
            )
        total += len(kernels)
    return total


def forget_compiled(kernel) -> None:
    """Empty ``kernel``'s in-memory caches of compiled variants (the next launch of each loads
    it again, from Triton's disk cache), so that a test counts the variants it compiles itself
    whatever ran before it in this process."""
    compiled_variants(kernel)  # fails clearly on an unknown layout
    caches = getattr(kernel, "device_caches", None)
    if caches is None:  # not `or`: an empty device_caches (nothing compiled yet) is falsy
        caches = kernel.cache
    for entry in caches.values():
        for part in entry if isinstance(entry, (tuple, list)) else (entry,):
            if isinstance(part, dict):
                part.clear()


def test_compiled_variants_reads_both_layouts_and_refuses_others():
    kernels = {"k1": object(), "k2": object()}
    five = SimpleNamespace(device_caches={0: (kernels, {}, "target", "backend", "binder")})
    assert compiled_variants(five) == 2
    four = SimpleNamespace(device_caches={0: (kernels, "target", "backend", "binder"), 1: ({},)})
    assert compiled_variants(four) == 2
    assert compiled_variants(SimpleNamespace(cache={0: kernels, 1: {"k3": 0}})) == 3
    for bad in (
        SimpleNamespace(),
        SimpleNamespace(device_caches=None, cache=[]),
        SimpleNamespace(device_caches={0: ("target", kernels)}),
    ):
        with pytest.raises(pytest.fail.Exception, match="update compiled_variants"):
            compiled_variants(bad)


def _kernel(kind: str):
    """The Triton JIT function of backend rule ``kind``."""
    from memopt_kernels_triton.kernels import adam, lion, sgd

    return {"adam": adam.adam_kernel, "lion": lion.lion_kernel, "sgd": sgd.sgd_kernel}[kind]


SIZES = [0, 1, 33, 4097, 65537]
#: advancing step numbers, multiples of 16 among them (Triton specializes an integer argument
#: on divisibility by 16 unless the kernel says not to)
STEPS = [1, 2, 3, 16, 17, 32]
#: (lr factor of the variant's lr, weight decay) of those steps: every value new, none zero (a
#: zero decay is another compiled variant: the end of the test checks that the count sees it)
SCHEDULE = [(1.0, 0.1), (0.3, 0.05), (2.0, 0.2), (0.1, 0.01), (1.5, 0.3), (0.7, 0.02)]
#: launch geometries (rows, warps), one per API
GEOMETRY = {"fused": (8, 2), "prepared": (32, 8)}


@pytest.mark.gpu
@pytest.mark.skipif(_INTERPRETING, reason="counts compiled GPU kernels: unset TRITON_INTERPRET")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("api", ["fused", "prepared"])
@pytest.mark.parametrize("variant", ["adamw", "sgd-mom-damp-l2", "sgdw-mom", "lion"])
def test_new_lr_and_weight_decay_reuse_the_compiled_kernel(ops, variant, api):
    rule, hyper = VARIANTS[variant]
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    ref = make_group(rule, spec, torch.bfloat16, SIZES, "cuda", seed=2**32 - 5, **hyper)
    mine = ref.clone()
    kernel = _kernel(ref.kind)
    rows, warps = GEOMETRY[api]
    config = ops.KernelConfig(rows=rows, num_warps=warps)
    grads = [torch.empty_like(p) for p in mine.params]  # the prepared step's stable buffers
    prepared = None

    def step(n: int, lr: float, wd: float) -> int:
        """Step ``n`` of both groups with ``lr`` and ``wd``; the compiled variants after it."""
        nonlocal prepared
        for g in (ref, mine):
            g.hyper.update(lr=lr, weight_decay=wd)
        new = make_grads(ref, n)
        TORCH.step(group_step(ref, new, n))
        if api == "fused":
            ops.fused_step(group_step(mine, new, n), config)
        else:
            for buf, g in zip(grads, new, strict=True):
                buf.copy_(g)
            work = group_step(mine, grads, n)
            if prepared is None:
                prepared = ops.prepare_step(work, config)
                assert prepared.reusable
            prepared.launch(work.scalars, n, work.seed, work.first_step)
        torch.cuda.synchronize()
        bad = diff_report(ref, mine)
        assert not bad, f"step {n} (lr {lr}, weight decay {wd}): " + "; ".join(bad)
        return compiled_variants(kernel)

    lr0 = hyper["lr"]
    forget_compiled(kernel)
    before = compiled_variants(kernel)
    assert before == 0
    counts = [step(n, lr0 * f, wd) for n, (f, wd) in zip(STEPS, SCHEDULE, strict=True)]
    # a host launch of SGD with momentum compiles its first step apart (FIRST, compile-time)
    warm = 2 if ref.kind == "sgd" and hyper.get("momentum", 0.0) else 1
    assert counts[0] == before + 1, f"the first step compiled {counts[0] - before} variants"
    assert counts[warm - 1] == before + warm, counts
    assert counts[warm:] == [before + warm] * (len(STEPS) - warm), (
        f"compiled variants over steps {STEPS} (lr and weight decay new each step): {counts}, "
        f"{before} before"
    )
    # the count does see a recompile: a zero weight decay drops the decay (or L2) term
    assert step(STEPS[-1] + 1, lr0, 0.0) == before + warm + 1
