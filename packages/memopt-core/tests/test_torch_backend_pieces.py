"""The torch backend's pieces: cutting a group into bounded pieces changes no bit and bounds memory.

``TorchBackend.step`` processes a group in pieces of at most ``MEMOPT_TORCH_PIECE`` elements
(large tensors cut at block boundaries, small ones packed together). A forced small piece size
must give exactly the bits of the default one, including partial steps, padding, non-contiguous
parameters and stochastic rounding; the largest transient allocation must follow the piece size,
not the group's size.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memopt_core import MemOptimizer, torch_backend
from memopt_core.errors import ConfigError
from memopt_core.formats import StateSpec
from memopt_core.plan import GroupPlan
from memopt_core.torch_backend import TorchBackend

SIZES = [0, 1, 31, 33, 100, 1000]
# (master, moments, stochastic rounding, parameter dtype)
CONFIGS = {
    "fp32-q8": ("fp32", "q8", False, torch.float32),
    "ecc24-q8-sr": ("ecc24", "q8", True, torch.bfloat16),
}
RULES = {
    "adamw": dict(lr=1e-2, weight_decay=0.1),
    "sgd": dict(lr=0.05, momentum=0.9, nesterov=True),
    "lion": dict(lr=1e-3, weight_decay=0.1),
}


@pytest.fixture
def piece_size(monkeypatch):
    """Set the torch backend's piece size for the test (the environment variable cleared)."""
    monkeypatch.delenv("MEMOPT_TORCH_PIECE", raising=False)

    def set_piece(n: int) -> None:
        monkeypatch.setattr(torch_backend, "MEMOPT_TORCH_PIECE", n)

    return set_piece


def _params(dtype, device):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    params.append(torch.randn(30, 50, generator=gen).t())  # non-contiguous, cut mid-row
    params.append(torch.randn((), generator=gen))
    params = [p.to(device=device, dtype=dtype).requires_grad_() for p in params]
    for p in params:
        p.grad_dtype = None  # allow float32 gradients on low-precision parameters
    return params


def _run(rule, cfg, device, steps=3):
    master, moments, sr, dtype = CONFIGS[cfg]
    params = _params(dtype, device)
    opt = MemOptimizer(
        params,
        rule=rule,
        master=master,
        moments=moments,
        stochastic_rounding=sr,
        seed=7,
        backend="torch",
        **RULES[rule],
    )
    gen = torch.Generator().manual_seed(1)
    for t in range(steps):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen).to(device)
            # tensor 2 skips step 1: the next steps are partial (two step counts in the group)
            p.grad = None if (t == 1 and i == 2) else (g.to(dtype) if i % 2 else g)
        opt.step()
    return params, opt


@pytest.mark.parametrize("piece", [32, 64, 96])
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("rule", list(RULES))
def test_small_pieces_are_bit_identical(rule, cfg, piece, piece_size, device):
    expected, ref_opt = _run(rule, cfg, device)
    piece_size(piece)
    got, opt = _run(rule, cfg, device)
    for i, (p, q) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(p.detach(), q.detach()), f"parameter {i} differs"
        state, ref_state = opt.state[p], ref_opt.state[q]
        assert state.keys() == ref_state.keys()
        for key, value in ref_state.items():
            assert torch.equal(state[key], value), f"state {key!r} of parameter {i} differs"


def _cut(sizes, piece):
    """The plan of fp32 tensors of ``sizes`` with q8 moments (blocks of 32), and its pieces."""
    plan = GroupPlan([torch.zeros(n) for n in sizes], StateSpec(master="fp32", moments="q8"))
    assert plan.block_size == 32
    return plan, torch_backend._cut(plan.slots, piece)


def test_cut_covers_each_tensor_once_in_whole_blocks():
    plan, pieces = _cut([0, 1, 31, 33, 100, 1000, 5000, 64], 256)
    covered = {slot.index: 0 for slot in plan.slots}
    for piece in pieces:
        assert piece.length == sum(s.length for s in piece.segments) <= 256
        assert sum(n for _, n in piece.runs) == piece.length
        for seg in piece.segments:
            slot = plan.slots[seg.pos]
            assert seg.start % 32 == 0
            assert seg.length % 32 == 0
            assert seg.start == covered[seg.pos]  # in order, no gap, no overlap
            assert seg.real == max(0, min(seg.length, slot.numel - seg.start))
            covered[seg.pos] += seg.length
    assert covered == {slot.index: slot.padded for slot in plan.slots}
    assert [p.length for p in pieces[:-1]] == [256] * (len(pieces) - 1)  # only the last is short


def test_small_tensors_share_pieces():
    # 4096 tensors of 32 elements: 8 pieces of 512 tensors, each one arena run
    _, pieces = _cut([32] * 4096, 2**14)
    assert len(pieces) == 8
    assert all(len(p.segments) == 512 and len(p.runs) == 1 for p in pieces)


class _CountOps(TorchDispatchMode):
    """Counts calls of each aten op and records the largest newly allocated output."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        self.calls[name] = self.calls.get(name, 0) + 1
        fresh = all(r.alias_info is None for r in func._schema.returns)  # not a view or in-place
        if fresh:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _traced_step(monkeypatch, params, **opts) -> _CountOps:
    """One step after a warm-up step, with every op of the backend's step counted."""
    opt = MemOptimizer(params, rule="adamw", backend="torch", **opts)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # allocates the arena: not transient
    mode = _CountOps()
    plain = TorchBackend.step

    def traced(self, work):
        with mode:
            plain(self, work)

    monkeypatch.setattr(TorchBackend, "step", traced)
    opt.step()
    monkeypatch.setattr(TorchBackend, "step", plain)
    return mode


def test_many_small_tensors_cost_the_ops_of_one(monkeypatch, piece_size):
    piece_size(2**22)
    one = _traced_step(monkeypatch, [torch.randn(2048 * 32)], moments="q8")
    many = _traced_step(monkeypatch, [torch.randn(32) for _ in range(2048)], moments="q8")
    # the rule, the codecs and the Philox rounds run once per piece whatever the number of
    # tensors; only the gather and scatter views and copies are per tensor
    per_tensor = {"aten.slice", "aten.view", "aten.detach", "aten.copy_"}
    for op, count in many.calls.items():
        if op not in per_tensor:
            assert count <= one.calls.get(op, 0) + 4, op
    for op in ("aten.mul", "aten.sqrt", "aten.where", "aten.bitwise_xor"):
        assert many.calls[op] == one.calls[op], op


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_largest_transient_allocation_follows_the_piece(cfg, monkeypatch, piece_size):
    master, moments, sr, dtype = CONFIGS[cfg]
    piece = 1024
    piece_size(piece)
    # 64 pieces' worth in one tensor plus small ones: a whole-group step would allocate
    # int64 vectors of the whole group (512 bytes per piece element)
    params = [torch.randn(64 * piece).to(dtype)] + [torch.randn(n).to(dtype) for n in SIZES]
    mode = _traced_step(
        monkeypatch,
        params,
        master=master,
        moments=moments,
        stochastic_rounding=sr,
        check_numerics=False,
    )
    # int64 work vectors are 8 bytes per element; q8's stochastic rounding decodes the two
    # candidate codes of each element in one vector of twice the piece
    assert 0 < mode.largest <= 16 * piece


@pytest.mark.parametrize("bad", ["0", "48", "-32", "many"])
def test_bad_piece_size_is_a_config_error(bad, monkeypatch):
    monkeypatch.setenv("MEMOPT_TORCH_PIECE", bad)
    p = torch.randn(10, requires_grad=True)
    opt = MemOptimizer([p], rule="adamw", moments="q8", backend="torch")
    p.grad = torch.randn(10)
    with pytest.raises(ConfigError, match="MEMOPT_TORCH_PIECE"):
        opt.step()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_memory_follows_the_piece(piece_size):
    piece = 2**20
    piece_size(piece)
    n = 16 * piece
    p = torch.randn(n, device="cuda").to(torch.bfloat16).requires_grad_()
    opt = MemOptimizer(
        [p],
        rule="adamw",
        master="ecc24",
        moments="q8",
        stochastic_rounding=True,
        backend="torch",
        check_numerics=False,  # its isfinite pass over the gradient is not the backend's
    )
    p.grad = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    # about 280 bytes per piece element (module doc); a whole-group step needs that per tensor
    # element, 16x more here
    assert extra <= 384 * piece


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda g: torch.zeros(34, dtype=g.dtype), r"34 elements on cpu; its parameter has 33"),
        (lambda g: torch.zeros(32, dtype=g.dtype), r"32 elements on cpu; its parameter has 33"),
        (lambda g: g.double(), r"is torch\.float64: gradients must have"),
        (lambda g: torch.zeros(g.shape, dtype=torch.int32), r"is torch\.int32"),
        (lambda g: g.float().to(torch.complex64), r"is torch\.complex64"),
        (lambda g: g.to_sparse(), r"torch\.sparse_coo tensor"),
        (lambda g: g.to("meta"), r"on meta"),
        (lambda g: torch._neg_view(g.float()), r"is a negated view"),
        (lambda g: None, r"must be a torch\.Tensor, got NoneType"),
    ],
    ids=["bigger", "smaller", "float64", "int32", "complex", "sparse", "meta", "negated", "none"],
)
def test_a_direct_step_refuses_gradients_it_cannot_take(bad, message):
    """Called directly (MemOptimizer checks gradients before it calls a backend), the torch
    backend refuses a gradient of another size or dtype as the kernels do: it updated part of
    the group, or ran with the values converted, or failed deep inside torch."""
    from memopt_core.testing import VARIANTS, group_step, make_grads, make_group

    rule, hyper = VARIANTS["adamw"]
    spec = StateSpec(master="ecc24", moments="q8", stochastic_rounding=True)
    group = make_group(rule, spec, torch.bfloat16, [33, 40], "cpu", **hyper)
    grads = make_grads(group, 1)
    before = [p.clone() for p in group.params]
    work = group_step(group, [bad(grads[0]), grads[1]], 1)
    with pytest.raises(
        ConfigError, match=r"the gradient of parameter 0 \(plan slot 0\).*" + message
    ):
        TorchBackend().step(work)
    assert all(torch.equal(a, b) for a, b in zip(before, group.params, strict=True))
