"""GPU-only checks: a tensor past 2**31 elements (32-bit index overflow; Adam, SGD with momentum
and Lion), CUDA-graph capture of a fused step, and index bases (``GroupStep.index_bases``) over
the whole rule x format matrix."""

from __future__ import annotations

import fcntl
import gc
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

from memopt_core import reference, rng
from memopt_core.backends import GroupStep
from memopt_core.formats import StateSpec
from memopt_core.plan import GroupPlan, StateArena
from memopt_core.testing import (
    MASTER_IDS,
    MASTERS,
    PRESETS,
    VARIANTS,
    diff_report,
    make_grads,
    make_group,
    step_group,
)
from memopt_core.torch_backend import TorchBackend
from memopt_kernels_triton.backend import BACKEND

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _window_reference(spec, arena, p, g, code, s, seed, tid, step, lo, hi):
    """Core's codecs and rule applied to elements [lo, hi) of one tensor (block aligned)."""
    master = spec.master_for(p.dtype)
    x = master.decode(p[lo:hi], code[lo:hi]).float()
    m_codec, v_codec = arena.codecs["exp_avg"], arena.codecs["exp_avg_sq"]
    fm = {
        k: (t[lo:hi] if k == "" else t[lo // 32 : hi // 32])
        for k, t in arena.fields["exp_avg"].items()
    }
    fv = {
        k: (t[lo:hi] if k == "" else t[lo // 32 : hi // 32])
        for k, t in arena.fields["exp_avg_sq"].items()
    }
    x, m, v = reference.adam(x, g[lo:hi].float(), m_codec.decode(fm), v_codec.decode(fv), s)
    w = rng.stream_words(seed, tid, torch.arange(lo, hi, device=p.device), step)
    pn, cn = master.encode(x, rand=w[0])
    return pn, cn, m_codec.encode(m, rand=w[1]), v_codec.encode(v, rand=w[2])


def _large_tensors(n, seed):
    """A seeded bf16 parameter and gradient of ``n`` elements on the GPU (filled a slice at a
    time: one randn of 2**31 floats would need 8 GiB more), and a 33-element parameter."""
    dev = torch.device("cuda")
    p = torch.empty(n, dtype=torch.bfloat16, device=dev)
    g = torch.empty(n, dtype=torch.bfloat16, device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    for i in range(0, n, 2**28):
        j = min(n, i + 2**28)
        p[i:j] = torch.randn(j - i, device=dev, generator=gen).to(torch.bfloat16)
        g[i:j] = (torch.randn(j - i, device=dev, generator=gen) * 1e-2).to(torch.bfloat16)
    return p, g, torch.randn(33, device=dev).to(torch.bfloat16)


def _pair_step(kind, spec, plan, params, g, arena, s, step, seed, tids):
    """The work of one step of ``params`` (the small tensor, with a zero gradient, and the
    large one with ``g``)."""
    small, p = params
    return GroupStep(
        kind, spec, plan, [0, 1], [small, p], [torch.zeros_like(small), g], arena, s, step,
        seed, tids, step == 1,
    )  # fmt: skip


@pytest.mark.usefixtures("_free_gpu_memory")
def test_tensor_past_2_pow_31_elements():
    n = 2**31 + 96
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs about 25 GiB of GPU memory")
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    p, g, small = _large_tensors(n, seed=0)
    plan = GroupPlan([small, p], spec)
    arena = StateArena(
        plan, {"exp_avg": spec.first, "exp_avg_sq": spec.second}, spec.master_for(torch.bfloat16)
    )
    seed, tids = 12345, [3, 2**32 + 9]
    code = arena.master_code[plan.slots[1].offset : plan.slots[1].offset + n]
    windows = [(0, 4096), (2**31 - 4096, 2**31 + 96)]

    def do_step(step):
        s = reference.adam_scalars(
            lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, step=step, decoupled=True
        )
        # views of tensor 1's state: the arena starts tensor 1 at slot.offset
        off = plan.slots[1].offset
        sub = _SubArena(arena, off, n)
        want = [
            _window_reference(spec, sub, p, g, code, s, seed, tids[1], step, lo, hi)
            for lo, hi in windows
        ]
        work = _pair_step("adam", spec, plan, (small, p), g, arena, s, step, seed, tids)
        BACKEND.step(work)
        torch.cuda.synchronize()
        for (lo, hi), (pn, cn, fm, fv) in zip(windows, want, strict=True):
            assert torch.equal(p[lo:hi].view(torch.int16), pn.view(torch.int16)), (lo, hi)
            assert torch.equal(code[lo:hi], cn), (lo, hi)
            for name, f in (("exp_avg", fm), ("exp_avg_sq", fv)):
                for k, t in f.items():
                    stored = sub.fields[name][k]
                    got = stored[lo:hi] if k == "" else stored[lo // 32 : hi // 32]
                    assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), (name, k, lo)

    do_step(1)
    do_step(2)


def _rule_window_reference(kind, spec, arena, p, g, code, s, seed, tid, step, lo, hi):
    """Core's codecs and SGD (``kind`` "sgd", momentum) or Lion rule applied to elements
    [lo, hi) of one tensor (block aligned): the new parameter, master code and state fields."""
    master = spec.master_for(p.dtype)
    x = master.decode(p[lo:hi], code[lo:hi]).float()
    name = "momentum_buffer" if kind == "sgd" else "exp_avg"
    codec = arena.codecs[name]
    fields = {
        k: (t[lo:hi] if k == "" else t[lo // 32 : hi // 32]) for k, t in arena.fields[name].items()
    }
    gw = g[lo:hi].float()
    if kind == "sgd":  # the first step starts the buffer from the gradient, as core's backend
        buf = None if step == 1 else codec.decode(fields)
        x, new = reference.sgd(x, gw, buf, s, first_step=step == 1)
    else:
        x, new = reference.lion(x, gw, codec.decode(fields), s)
    w = rng.stream_words(seed, tid, torch.arange(lo, hi, device=p.device), step)
    pn, cn = master.encode(x, rand=w[0])
    return pn, cn, codec.encode(new, rand=w[1])


@pytest.fixture
def _free_gpu_memory():
    """One large test at a time across pytest-xdist's workers (a file lock; 12 workers ran
    three of them together and one ran out of an H100's 80 GB), and the caching allocator's
    blocks given back after it (passed or failed), so the next large case starts from an
    empty GPU."""
    lock = Path(tempfile.gettempdir()) / "memopt-kernels-triton-gpu-large.lock"
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            gc.collect()
            torch.cuda.empty_cache()
            fcntl.flock(f, fcntl.LOCK_UN)


def _large_rule_case(kind):
    """Two steps (SGD's first step and a later one) of one SGD-with-momentum or Lion group of a
    33-element tensor and one of 2**31 + 96 elements: windows at the start, around 2**31 and
    at the end of the large tensor give core's bits. About 13 GiB of GPU memory (bf16
    parameters and gradients, ECC-24 codes, one q8 state)."""
    n = 2**31 + 96
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    p, g, small = _large_tensors(n, seed=1)
    plan = GroupPlan([small, p], spec)
    name = "momentum_buffer" if kind == "sgd" else "exp_avg"
    arena = StateArena(plan, {name: spec.first}, spec.master_for(torch.bfloat16))
    assert plan.slots[1].offset + n > 2**31  # arena indices past 2**31 too
    seed, tids = 12345, [3, 2**32 + 9]
    off = plan.slots[1].offset
    code = arena.master_code[off : off + n]
    sub = _SubArena(arena, off, n)
    windows = [(0, 4096), (2**31 - 4096, 2**31 + 96)]  # the second one ends the tensor
    for step in (1, 2):
        if kind == "sgd":
            s = reference.sgd_scalars(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-2)
        else:
            s = reference.lion_scalars(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
        want = [
            _rule_window_reference(kind, spec, sub, p, g, code, s, seed, tids[1], step, lo, hi)
            for lo, hi in windows
        ]
        before = [(p[lo:hi].clone(), code[lo:hi].clone()) for lo, hi in windows]
        work = _pair_step(kind, spec, plan, (small, p), g, arena, s, step, seed, tids)
        BACKEND.step(work)
        torch.cuda.synchronize()
        for (lo, hi), (pn, cn, fields), (p0, c0) in zip(windows, want, before, strict=True):
            where = (kind, step, lo, hi)
            # the reference moved the weights: a step that wrote nothing would fail below
            assert not (torch.equal(pn, p0) and torch.equal(cn, c0)), where
            assert torch.equal(p[lo:hi].view(torch.int16), pn.view(torch.int16)), where
            assert torch.equal(code[lo:hi], cn), where
            for k, t in fields.items():
                stored = sub.fields[name][k]
                got = stored[lo:hi] if k == "" else stored[lo // 32 : hi // 32]
                assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), (*where, k)


@pytest.mark.usefixtures("_free_gpu_memory")
@pytest.mark.parametrize("kind", ["sgd", "lion"])
def test_sgd_and_lion_past_2_pow_31_elements(kind):
    """SGD with momentum and Lion (ECC-24 master, q8 state) on a tensor past 2**31 elements:
    32-bit index overflow in the parameter, gradient, code and state addressing."""
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs about 15 GiB of GPU memory")
    failure = None
    try:
        _large_rule_case(kind)
    except Exception:
        # reported as text: a kept traceback would hold the case's 13 GiB of tensors alive
        failure = traceback.format_exc()
    if failure is not None:
        pytest.fail(failure, pytrace=False)


class _SubArena:
    """The arena fields of one slot (offset ``off``, ``n`` elements, blocks of 32)."""

    def __init__(self, arena, off, n):
        self.codecs = arena.codecs
        self.fields = {
            name: {
                k: (t[off : off + n] if k == "" else t[off // 32 : (off + n) // 32])
                for k, t in fs.items()
            }
            for name, fs in arena.fields.items()
        }


def test_cuda_graph_capture():
    """A fused step captured in a CUDA graph replays the same bits as eager steps (scalars are
    baked into the graph: replaying repeats the captured step)."""
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    a = make_group(
        "adamw", spec, torch.bfloat16, [1, 33, 4097, 70000], "cuda", lr=1e-2, weight_decay=0.1
    )
    b = a.clone()
    g1, g2 = make_grads(a, 1), make_grads(a, 2)
    torch_backend = TorchBackend()
    step_group(torch_backend, a, g1, 1)
    step_group(torch_backend, a, g2, 2)
    step_group(torch_backend, a, g2, 2)
    step_group(BACKEND, b, g1, 1)
    step_group(BACKEND, b, g2, 2)  # warm: compiled, tables cached
    # rewind b to after step 1 is not possible; instead capture "step 2" and replay it once more
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        step_group(BACKEND, b, g2, 2)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert not diff_report(a, b)


# odd sizes, the large one over many chunks; 4097 elements from 2**32 - 1000 carry into the
# index's high word
BASE_SIZES = [1, 31, 33, 4097, 1_000_003]
BASES = [5, 2**31 + 7, 2**33 + 1, 2**32 - 1000, 2**40 + 3]


@pytest.mark.parametrize("master", MASTERS, ids=MASTER_IDS)
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_index_bases_full_matrix(variant, preset, master):
    """With nonzero index bases the fused step gives the torch backend's bits (stochastic
    rounding on), every rule variant x moment preset x master."""
    rule, hyper = VARIANTS[variant]
    name, dtype = master
    spec = StateSpec(master=name, moments=preset, stochastic_rounding=True)
    a = make_group(
        rule, spec, dtype, BASE_SIZES, "cuda", seed=2**32 - 5, index_bases=BASES, **hyper
    )
    b = a.clone()
    torch_backend = TorchBackend()
    for step in range(1, 4):
        grads = make_grads(a, step)
        step_group(torch_backend, a, grads, step)
        step_group(BACKEND, b, grads, step)
        bad = diff_report(a, b)
        assert not bad, f"step {step}: " + "; ".join(bad)


@pytest.mark.usefixtures("_free_gpu_memory")
def test_stream_words_past_2_pow_30_indices():
    """Stream 2 starts 2 * n words into the output: past 2**30 indices that offset overflowed
    int32 and the words landed before the output (about 44 GiB of GPU memory: 8 GiB of int64
    indices, 12 GiB of int32 words and their 24 GiB of int64 words)."""
    from memopt_kernels_triton import ops

    if torch.cuda.get_device_properties(0).total_memory < 60 * 2**30:
        pytest.skip("needs about 44 GiB of GPU memory")
    n = 2**30 + 64
    index = torch.empty(n, dtype=torch.int64, device="cuda")
    index[-64:] = torch.arange(5, 69, device="cuda")
    index[:-64] = 0
    seed, tid, step = 11, 3, 7
    words = ops.stream_words(seed, tid, index, step)
    want = rng.stream_words(seed, tid, torch.arange(5, 69), step)
    for s in range(3):
        assert torch.equal(words[s][-64:].cpu(), want[s]), f"stream {s}"
