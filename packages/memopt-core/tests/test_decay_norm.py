"""Decay-normalized second moments (docs/formats.md): Adam's 8-bit second moments are stored
as ``u = v / N``, ``N = beta2**(step % P)``. These tests check what ``u`` stands for from the
outside: after a change of beta2, after loading a version-1 state dict (which stored ``v``
itself), and through ``MemOptimizer.decay_norm``."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from memopt_core import ConfigError, MemOptimizer, StateDictError, conversions, reference
from memopt_core.formats import MOMENT_PRESETS, StateSpec, moment_codec

N = 512
#: mean relative error of a stochastically rounded v against fp64's in these runs: measured
#: 0.04-0.06 (q8) and 0.08-0.10 (fp8)
TOL = {"q8": 0.08, "fp8": 0.15}


def _v(opt: MemOptimizer, p: torch.Tensor) -> torch.Tensor:
    """The second moment ``v`` the optimizer holds for ``p`` (decoded, times ``decay_norm``)."""
    st = opt.state[p]
    codec = moment_codec(MOMENT_PRESETS[opt.param_groups[0]["moments"]][1])
    u = codec.decode({s: st["exp_avg_sq" if s == "" else f"exp_avg_sq_{s}"] for s in codec.fields})
    return conversions.denormalize_second_moment(u[:N], opt.decay_norm(0, int(st["step"])))


def _run(opt, p, grads, v32, beta2):
    for g in grads:
        p.grad = g.clone()
        opt.step()
        v32.mul_(beta2).add_((1 - beta2) * g.double() ** 2)


def _grads(steps: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=gen) for _ in range(steps)]


def _close(v: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean relative error of ``v`` against the fp64 ``ref``."""
    return ((v.double() - ref) / ref).abs().mean().item()


@pytest.mark.parametrize("moments", ["fp8", "q8"])
def test_spec_and_norm(moments):
    assert StateSpec(moments=moments).decay_normalized
    assert not StateSpec(moments="bf16").decay_normalized
    p = torch.nn.Parameter(torch.randn(N))
    opt = MemOptimizer([p], betas=(0.9, 0.9), moments=moments)
    period = reference.decay_norm_period(0.9)
    assert 0.9**period >= 2**-8 > 0.9 ** (period + 1)
    for k in (0, 1, period - 1, period, period + 3):
        assert opt.decay_norm(0, k) == 0.9 ** (k % period)
    assert (
        MemOptimizer([torch.nn.Parameter(torch.randn(3))], moments="bf16").decay_norm(0, 5) == 1.0
    )


@pytest.mark.parametrize("moments", ["fp8", "q8"])
def test_a_changed_beta2_renormalizes_the_stored_moments(moments):
    """12 steps at beta2 0.9 (P = 52), then 30 at 0.6 (P = 10): the stored moments are
    re-encoded for the new beta2 before its first step, so ``v`` keeps tracking fp64's.
    Without that, ``v`` would be read with the new beta2's ``N``: off by 0.9**12 / 0.6**2."""
    p = torch.nn.Parameter(torch.randn(N))
    opt = MemOptimizer([p], lr=1e-3, betas=(0.9, 0.9), moments=moments)
    v32 = torch.zeros(N, dtype=torch.float64)
    _run(opt, p, _grads(12, 0), v32, 0.9)
    assert _close(_v(opt, p), v32) < TOL[moments]
    opt.param_groups[0]["betas"] = (0.9, 0.6)
    _run(opt, p, _grads(1, 1), v32, 0.6)
    assert opt.state_dict()["memopt"]["decay_norm_beta2"] == [0.6]
    assert _close(_v(opt, p), v32) < TOL[moments]
    _run(opt, p, _grads(29, 2), v32, 0.6)
    assert _close(_v(opt, p), v32) < TOL[moments]


@pytest.mark.parametrize("moments", ["fp8", "q8"])
def test_a_version_1_state_dict_holds_v_and_is_normalized_at_the_next_step(moments):
    p = torch.nn.Parameter(torch.randn(N))
    opt = MemOptimizer([p], lr=1e-3, betas=(0.9, 0.9), moments=moments)
    v32 = torch.zeros(N, dtype=torch.float64)
    _run(opt, p, _grads(20, 0), v32, 0.9)
    sd = copy.deepcopy(opt.state_dict())
    # what memopt before version 2 saved: v itself, and no normalizing beta2
    codec = moment_codec(MOMENT_PRESETS[moments][1])
    st = sd["state"][0]
    raw = codec.encode(torch.nn.functional.pad(_v(opt, p), (0, st["exp_avg_sq"].numel() - N)))
    for s, x in raw.items():
        st["exp_avg_sq" if s == "" else f"exp_avg_sq_{s}"] = x
    for meta in [sd["memopt"]] + [g["memopt"] for g in sd["param_groups"]]:
        meta["version"] = 1
        del meta["decay_norm_beta2"]
    q = torch.nn.Parameter(p.detach().clone())
    old = MemOptimizer([q], lr=1e-3, betas=(0.9, 0.9), moments=moments)
    old.load_state_dict(sd)
    assert old.decay_norm(0, 20) == 1.0  # read as v until the next step normalizes it
    assert _close(_v(old, q), v32) < TOL[moments]
    _run(old, q, _grads(5, 1), v32.clone(), 0.9)
    ref = v32.clone()
    _run(opt, p, _grads(5, 1), ref, 0.9)
    assert old.decay_norm(0, 25) == reference.decay_norm(0.9, 25)
    assert _close(_v(old, q), ref) < TOL[moments]
    assert _close(_v(old, q), _v(opt, p).double()) < 2 * TOL[moments]


def _twins(moments, beta2=0.9):
    """Two optimizers over equal parameters, each stepped 8 times on the same gradients."""
    ps = [torch.nn.Parameter(torch.randn(N, generator=torch.Generator().manual_seed(7)))]
    ps.append(torch.nn.Parameter(ps[0].detach().clone()))
    opts = [MemOptimizer([p], lr=1e-3, betas=(0.9, beta2), moments=moments) for p in ps]
    for opt, p in zip(opts, ps, strict=True):
        _run(opt, p, _grads(8, 0), torch.zeros(N, dtype=torch.float64), beta2)
    return opts, ps


def _continue_equal(a, p, b, q, betas=(0.9, 0.6)):
    """Both optimizers step 6 more times on the same gradients: the same bits."""
    for opt, param in ((a, p), (b, q)):
        opt.param_groups[0]["betas"] = betas
        _run(opt, param, _grads(6, 3), torch.zeros(N, dtype=torch.float64), betas[1])
    assert torch.equal(p, q)
    for k in a.state[p]:
        assert torch.equal(a.state[p][k], b.state[q][k]), k


@pytest.mark.parametrize("moments", ["fp8", "q8"])
def test_a_dict_without_its_record_reads_its_groups_beta2(moments):
    """torch's get_state_dict / set_state_dict with flatten_optimizer_state_dict=True drop the
    ``memopt`` entry: the moments are read as normalized with the saved group's beta2, and
    state_dict() converts them to a beta2 changed since the last step first (the record was
    the only place that change showed). Read as v, the next step's v was 20x too large."""
    (a, _), (p, q) = _twins(moments)
    a.param_groups[0]["betas"] = (0.9, 0.6)  # no step since
    sd = copy.deepcopy(a.state_dict())
    assert sd["memopt"]["decay_norm_beta2"] == [0.6]  # converted by state_dict()
    del sd["memopt"]
    for g in sd["param_groups"]:
        del g["memopt"]
    fresh = MemOptimizer([q], lr=1e-3, betas=(0.9, 0.99), moments=moments)
    fresh.load_state_dict(sd)
    assert fresh.decay_norm(0, 8) == a.decay_norm(0, 8) == reference.decay_norm(0.6, 8)
    _continue_equal(a, p, fresh, q)


@pytest.mark.parametrize("other", ["q8 beta2 0.9", "fp32 moments"])
def test_param_groups_handed_back_in_another_order_keep_their_normalization(other):
    """torch's set_state_dict matches saved param groups to live ones by parameter names and
    hands them back in the live order, each with a copy of the ``memopt`` entry, whose
    ``decay_norm_beta2`` list is by the saved order. Read by position, a q8 group took the
    other group's beta2 (v off 2.08x) or its None (v read as v itself: 20x)."""
    torch.manual_seed(0)
    moments, beta2 = ("q8", 0.9) if other.startswith("q8") else ("fp32", 0.999)

    def build(params, reverse):
        groups = [
            {"params": params[:1], "betas": (0.9, 0.999), "moments": "q8"},
            {"params": params[1:], "betas": (0.9, beta2), "moments": moments},
        ]
        return MemOptimizer(groups[::-1] if reverse else groups, lr=1e-2, stochastic_rounding=False)

    ps = [torch.nn.Parameter(torch.randn(N)) for _ in range(2)]
    a = build(ps, reverse=False)
    for g in _grads(3000, 0):
        for p in ps:
            p.grad = g.clone()
        a.step()
    sd = copy.deepcopy(a.state_dict())
    # what set_state_dict hands load_state_dict: the live order, the entry only in the groups
    del sd["memopt"]
    sd["param_groups"] = sd["param_groups"][::-1]
    sd["state"] = {1 - k: v for k, v in sd["state"].items()}
    sd["param_groups"][0]["params"], sd["param_groups"][1]["params"] = [0], [1]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    b = build(qs, reverse=True)
    b.load_state_dict(sd)
    assert b.decay_norm(1, 3000) == a.decay_norm(0, 3000) == reference.decay_norm(0.999, 3000)
    for g in _grads(5, 1):
        for p, q in zip(ps, qs, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    for p, q in zip(ps, qs, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("moments", ["fp8", "q8"])
def test_states_written_from_outside_follow_their_groups_beta2(moments):
    """ZeroRedundancyOptimizer's load writes ``optim.state`` and the param groups directly:
    the states it writes hold the saver's format, normalized with the group's beta2 it writes,
    not with the one recorded for the states they replace (a resumer that stepped at 0.99)."""
    (a, _), (p, _) = _twins(moments)
    q = torch.nn.Parameter(p.detach().clone())
    b = MemOptimizer([q], lr=1e-3, betas=(0.9, 0.99), moments=moments)
    q.grad = torch.randn(N)
    b.step()  # records 0.99
    with torch.no_grad():
        q.copy_(p)
    b.state[q] = {k: v.clone() for k, v in a.state[p].items()}
    b.param_groups[0]["betas"] = (0.9, 0.9)
    assert b.state_dict()["memopt"]["decay_norm_beta2"] == [0.9]
    _continue_equal(a, p, b, q)


def test_an_optimizer_pickled_before_the_normalization_reads_v():
    """An optimizer pickled by a memopt of state-dict version 1 has no record: its q8 second
    moments are v itself, read with ``decay_norm`` 1.0 until the next step normalizes them."""
    p = torch.nn.Parameter(torch.randn(N))
    opt = MemOptimizer([p], betas=(0.9, 0.9), moments="q8")
    p.grad = torch.randn(N)
    opt.step()
    state = opt.__getstate__()
    del state["_norm_beta2"]
    old = MemOptimizer.__new__(MemOptimizer)
    old.__setstate__(state)
    assert old.decay_norm(0, 1) == 1.0
    # a pickle of this version keeps the record
    opt.param_groups[0]["betas"] = (0.9, 0.5)  # not stepped since: still normalized with 0.9
    assert pickle.loads(pickle.dumps(opt)).decay_norm(0, 1) == opt.decay_norm(0, 1) == 0.9


@pytest.mark.parametrize(
    ("step", "count"),
    [
        (0, 0),
        (7, 7),
        (7.0, 7),
        (torch.tensor(12.0), 12),
        (torch.tensor([3]), 3),
        (2**40, 2**40),
        (-1, None),
        (2.5, None),
        (float("nan"), None),
        (float("inf"), None),
        (10**400, None),  # an int beyond float's range
        (True, None),
        ("3", None),
        (None, None),
        (torch.tensor([1.0, 2.0]), None),
        (torch.tensor(1 + 1j), None),
    ],
)
def test_saved_step_count_takes_only_whole_counts(step, count):
    """The count a conversion denormalizes a saved second moment with: None, which leaves the
    entry to the load's checks, for anything that is not a whole number >= 0."""
    assert conversions.saved_step_count(step) == count


@pytest.mark.parametrize("moments", ["fp8", "q8"])
def test_a_beta2_schedule_keeps_v_tracking(moments):
    """beta2 ramped from 0.95 to 0.999, changed at every step: each change rescales the stored
    moments by well under a code step, and rounded to nearest every rescale was lost, always
    the same way (v/v64 reached 2e10 by the ramp's end and the weights stopped moving). The
    re-encoding rounds stochastically: the weights keep moving about as fp64 Adam's do."""
    torch.manual_seed(0)
    ramp, tail = 1500, 300
    p = torch.nn.Parameter(torch.zeros(N))
    opt = MemOptimizer([p], lr=1e-4, betas=(0.9, 0.95), moments=moments, weight_decay=0.0)
    m64, v64, p64 = (torch.zeros(N, dtype=torch.float64) for _ in range(3))
    for t in range(1, ramp + tail + 1):
        b2 = 0.95 + 0.049 * min(1.0, (t - 1) / ramp)
        g = 0.1 + torch.randn(N)
        m64.mul_(0.9).add_(0.1 * g.double())
        v64.mul_(b2).add_((1 - b2) * g.double() ** 2)
        p64 -= 1e-4 / (1 - 0.9**t) * m64 / ((v64 / (1 - b2**t)).sqrt() + 1e-8)
        opt.param_groups[0]["betas"] = (0.9, b2)
        p.grad = g
        opt.step()
        if t == ramp:
            start, start64 = p.detach().double().clone(), p64.clone()
    moved = (p.detach().double() - start).sum() / (p64 - start64).sum()
    assert 0.8 < moved < 1.3, moved


@pytest.mark.parametrize("moments", ["q8", "fp8"])
def test_the_step_limit_advice_keeps_v(moments):
    """The 2**24 warning's advice, a count with the same remainder modulo ``P``, keeps ``v`` bit
    for bit; 2**23 itself (the advice until 2026-12-06) read ``v`` 0.14x at beta2 0.999 until
    the dict recorded the count its moments are stored for (``decay_norm_step``): now it is
    converted, ``v`` kept within one re-encoding's rounding."""
    p = torch.zeros(N, requires_grad=True)
    opt = MemOptimizer([p], rule="adamw", lr=1e-3, moments=moments, backend="torch")
    p.grad = torch.ones(N)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["step"] = torch.tensor(float(2**24 - 7))
    opt.load_state_dict(sd)
    for g in _grads(7, 3):
        p.grad = g
        if int(opt.state[p]["step"]) < 2**24 - 1:
            opt.step()
            continue
        with pytest.warns(RuntimeWarning, match=r"decay_norm_period\(beta2\)"):
            opt.step()  # count 2**24
    v_before, step = _v(opt, p), int(opt.state[p]["step"])
    period = reference.decay_norm_period(0.999)
    sd = opt.state_dict()
    sd["state"][0]["step"] = torch.tensor(float(step - period * ((step - 2**23) // period)))
    opt.load_state_dict(sd)
    assert 2**23 <= int(opt.state[p]["step"]) < 2**23 + period
    torch.testing.assert_close(_v(opt, p), v_before, rtol=0, atol=0)
    sd["state"][0]["step"] = torch.tensor(float(2**23))
    opt.load_state_dict(sd)
    assert 0.95 < (_v(opt, p) / v_before).mean().item() < 1.05
    del sd["state"][0]["decay_norm_step"]  # a dict of stop 66 or before: read as stored for 2**23
    opt.load_state_dict(sd)
    assert (_v(opt, p) / v_before).mean().item() < 0.5


@pytest.mark.parametrize("moments", ["q8", "fp8"])
def test_a_beta2_schedule_gives_the_torch_backends_bits(moments, device):
    """Under a schedule every step re-encodes the stored moments for its beta2 (stochastically,
    through the backend's codec kernels where it has them): the cpu kernels (the Triton ones on
    CUDA) give the torch backend's bits, during the ramp and after it."""
    kernels = "cpu" if torch.device(device).type == "cpu" else "triton"
    pytest.importorskip(f"memopt_kernels_{kernels}")
    runs = []
    for backend in ("torch", kernels):
        gen = torch.Generator().manual_seed(3)
        p = torch.nn.Parameter(torch.randn(N, generator=gen).to(device))
        opt = MemOptimizer([p], lr=1e-3, betas=(0.9, 0.9), moments=moments, backend=backend)
        for t in range(120):
            opt.param_groups[0]["betas"] = (0.9, 0.9 + 0.09 * min(1.0, t / 100))
            p.grad = torch.randn(N, generator=gen).to(device)
            opt.step()
        runs.append((p.detach().clone(), _v(opt, p)))
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])


def _edit_count(opt: MemOptimizer, p: torch.Tensor, how: str, count: int) -> None:
    if how == "in place":  # torch users' restart of the bias corrections
        opt.state[p]["step"].fill_(count)
    else:
        opt.state[p]["step"] = torch.tensor(float(count))


@pytest.mark.parametrize("capturable", [False, True], ids=["eager", "capturable"])
@pytest.mark.parametrize(("how", "count"), [("in place", 0), ("assigned", 37)])
@pytest.mark.parametrize("moments", ["q8", "fp8"])
def test_an_edited_step_count_keeps_v(moments, how, count, capturable, device):
    """A step count edited after 100 steps at beta2 0.95 (P = 108): the stored ``u = v / N``
    is converted to the new count's ``N`` before the next step reads it, so ``v`` keeps
    tracking fp64's through the edit and after it (as torch keeps ``exp_avg_sq``). Read
    against the new count without the conversion, ``v`` was 169x fp64's (0.95**-100)."""
    if capturable and device.type != "cuda":
        pytest.skip("capturable steps keep their counts on a CUDA device")
    gen = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter(torch.randn(N, generator=gen).to(device))
    opt = MemOptimizer([p], lr=1e-3, betas=(0.9, 0.95), moments=moments, capturable=capturable)
    v64 = torch.zeros(N, dtype=torch.float64)
    grads = [torch.randn(N, generator=gen) for _ in range(131)]
    tol = {"q8": 0.13, "fp8": 0.22}[moments]  # measured 0.09-0.10 and 0.16-0.18 at beta2 0.95

    def run(gs):
        for g in gs:
            p.grad = g.to(device)
            opt.step()
            v64.mul_(0.95).add_(0.05 * g.double() ** 2)

    run(grads[:100])
    assert _close(_v(opt, p).cpu(), v64) < tol
    _edit_count(opt, p, how, count)
    run(grads[100:101])
    assert int(opt.state[p]["step"]) == count + 1
    assert _close(_v(opt, p).cpu(), v64) < tol
    run(grads[101:])
    assert _close(_v(opt, p).cpu(), v64) < tol
    _edit_count(opt, p, how, 5)  # seen by state_dict() too, which hands out u for count 5
    sd = opt.state_dict()
    assert int(sd["state"][0]["step"]) == 5
    assert _close(_v(opt, p).cpu(), v64) < tol


@pytest.mark.parametrize("moments", ["q8", "fp8"])
def test_a_count_edited_in_place_then_rebuilt_is_converted_once(moments):
    """A count edited in place before a step that rebuilds its group (a parameter appended to
    the group's list): the rebuild copies the moments stored for the old count and converts
    the copies, leaving the old ones as they were for a refused step to put back. The bits of
    a twin converted without the rebuild; read against the new count unconverted, ``v`` was
    169x fp64's (0.95**-100)."""
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(N, generator=gen) for _ in range(102)]
    runs = []
    for rebuilt in (False, True):
        p = torch.nn.Parameter(torch.linspace(-1, 1, N))
        opt = MemOptimizer([p], lr=1e-3, betas=(0.9, 0.95), moments=moments)
        for k, g in enumerate(grads):
            if k == 100:
                _edit_count(opt, p, "in place", 0)
                if rebuilt:
                    q = torch.nn.Parameter(torch.ones(5))
                    q.grad = torch.ones(5)
                    opt.param_groups[0]["params"].append(q)
            p.grad = g.clone()
            opt.step()
        assert int(opt.state[p]["step"]) == 2
        runs.append((p.detach(), {k: v.clone() for k, v in opt.state[p].items()}))
    (p_plain, plain), (p_rebuilt, rebuilt_state) = runs
    assert torch.equal(p_plain, p_rebuilt)
    assert plain.keys() == rebuilt_state.keys()
    for k, v in plain.items():
        assert torch.equal(v, rebuilt_state[k]), k


def test_counts_advanced_by_the_optimizer_convert_nothing(monkeypatch, device):
    """No edit, no conversion: steps of changing subsets (a parameter without a gradient
    keeps its count), replays of the cached step, a GradScaler's steps (on a GPU their counts
    move to the device and back), capturable steps, state_dict() and a reload of it never
    re-encode the second moments, whose counts the optimizer advanced itself."""
    calls = []
    monkeypatch.setattr(MemOptimizer, "_renormalize", lambda *a: calls.append(a))
    gen = torch.Generator().manual_seed(1)
    runs = [dict(capturable=False)]
    if device.type == "cuda":
        runs.append(dict(capturable=True))
    for kw in runs:
        ps = [torch.nn.Parameter(torch.randn(n, generator=gen).to(device)) for n in (33, 64, 7)]
        opt = MemOptimizer(ps, lr=1e-3, moments="q8", **kw)
        scaler = torch.amp.GradScaler(device.type, init_scale=4.0)
        for t in range(40):
            for i, p in enumerate(ps):
                skip = t % 5 == 1 and i == 1
                p.grad = None if skip else torch.randn(p.shape, generator=gen).to(device)
            if t % 3 == 2:
                scaler.scale(torch.ones((), device=device))  # as a loss would
                for p in ps:
                    if p.grad is not None:
                        p.grad *= 4.0
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if t == 20:
                opt.load_state_dict(opt.state_dict())
        assert [int(opt.state[p]["step"]) for p in ps] == [40, 32, 40]
    assert calls == []


@pytest.mark.parametrize("moments", ["q8", "fp32", "bf16"])
@pytest.mark.parametrize("bad", [float("nan"), -1.0, 2.5, float("inf")])
def test_an_edited_count_that_is_no_count_is_refused(bad, moments):
    """A count set in place to what no count is: refused before any write, naming the
    parameter (q8: its moments could not be converted to it; fp32 and bf16 moments, which take
    any count, raised a bare ValueError deep in the step for NaN and inf, and took a negative
    or a fraction), also on a replayed step."""
    p = torch.nn.Parameter(torch.randn(N))
    opt = MemOptimizer([p], lr=1e-3, moments=moments)
    for _ in range(3):  # replays from the second step on
        p.grad = torch.randn(N)
        opt.step()
    before = p.detach().clone()
    opt.state[p]["step"].fill_(bad)
    with pytest.raises(
        ConfigError, match=r"state\['step'\] of parameter #0 of param group 0 .*whole number >= 0"
    ):
        opt.step()
    assert torch.equal(p.detach(), before)


def _trained_q(moments: str, steps: int = 100) -> tuple[torch.nn.Parameter, MemOptimizer]:
    """A parameter and its optimizer after ``steps`` steps at beta2 0.95 (the same bits at
    every call)."""
    gen = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter(torch.randn(N, generator=gen))
    opt = MemOptimizer([p], lr=1e-3, betas=(0.9, 0.95), moments=moments)
    for _ in range(steps):
        p.grad = torch.randn(N, generator=gen)
        opt.step()
    return p, opt


@pytest.mark.parametrize("how", ["in a copy", "in place", "through torch.save"])
@pytest.mark.parametrize("moments", ["q8", "fp8"])
def test_a_count_edited_in_a_state_dict_is_converted(moments, how, tmp_path):
    """A state dict records the count each q8/fp8 second moment is stored for
    (``decay_norm_step``, a view of the optimizer's record that its steps advance): a count
    edited in the dict before ``load_state_dict`` is converted as the same edit in the
    optimizer is, bit for bit. Without the record, the stored ``u`` was read against the new
    count: ``v`` 169x (0.95**-100) here, silently."""
    p, opt = _trained_q(moments)
    v_before = _v(opt, p)
    sd = opt.state_dict()
    assert int(sd["state"][0]["decay_norm_step"]) == 100
    if how == "in place":
        sd["state"][0]["step"].zero_()  # the live dict's count is the optimizer's own
    else:
        sd = copy.deepcopy(sd)
        sd["state"][0]["step"] = torch.tensor(0.0)
        if how == "through torch.save":
            torch.save(sd, tmp_path / "sd.pt")
            sd = torch.load(tmp_path / "sd.pt")
    q = torch.nn.Parameter(torch.zeros(N))
    loaded = MemOptimizer([q], lr=1e-3, betas=(0.9, 0.95), moments=moments)
    loaded.load_state_dict(sd)
    assert int(loaded.state[q]["step"]) == 0
    p2, edited = _trained_q(moments)
    edited.state[p2]["step"].zero_()
    edited.settle_state()
    assert torch.equal(_v(loaded, q), _v(edited, p2))
    assert 0.9 < (_v(loaded, q) / v_before).mean().item() < 1.1


@pytest.mark.parametrize("moments", ["q8", "fp8"])
def test_a_count_edited_after_a_load_is_converted(moments):
    """A count edited in place after ``load_state_dict`` and before the first step (the
    loaded optimizer's counters were read only at that step, so its record took the edited
    count) is converted too: the bits of the same edit without the reload."""
    p, opt = _trained_q(moments)
    q = torch.nn.Parameter(p.detach().clone())
    loaded = MemOptimizer([q], lr=1e-3, betas=(0.9, 0.95), moments=moments)
    loaded.load_state_dict(opt.state_dict())
    loaded.state[q]["step"].zero_()
    opt.state[p]["step"].zero_()
    for o in (loaded, opt):
        o.settle_state()
    assert torch.equal(_v(loaded, q), _v(opt, p))
    g = torch.randn(N, generator=torch.Generator().manual_seed(9))
    for o, x in ((loaded, q), (opt, p)):
        x.grad = g.clone()
        o.step()
    assert torch.equal(_v(loaded, q), _v(opt, p))
    assert torch.equal(q.detach(), p.detach())


def test_a_state_dict_held_across_steps_converts_nothing(monkeypatch):
    """The dict's record is live, as its counts and moments are: a dict taken, then held
    while the optimizer steps (and so advances counts, moments and record together), loads
    with no conversion. Decoded dicts and formats that store ``v`` hold no record."""
    p, opt = _trained_q("q8", 10)
    sd = opt.state_dict()
    for _ in range(3):
        p.grad = torch.randn(N)
        opt.step()
    assert int(sd["state"][0]["step"]) == int(sd["state"][0]["decay_norm_step"]) == 13
    calls = []
    monkeypatch.setattr(MemOptimizer, "_renormalize", lambda *a: calls.append(a))
    opt.load_state_dict(sd)
    assert calls == []
    b = torch.nn.Parameter(torch.randn(N))
    bf16 = MemOptimizer([b], lr=1e-3, moments="bf16")
    b.grad = torch.randn(N)
    bf16.step()
    assert "decay_norm_step" not in bf16.state_dict()["state"][0]


@pytest.mark.parametrize("bad", [float("nan"), -1.0, 2.5, "7"])
def test_a_count_record_that_is_no_count_is_refused(bad):
    """A ``decay_norm_step`` that is no count is refused before anything is loaded, naming
    the parameter."""
    p, opt = _trained_q("q8", 3)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["decay_norm_step"] = bad if isinstance(bad, str) else torch.tensor(bad)
    before = _v(opt, p)
    with pytest.raises(StateDictError, match=r"'decay_norm_step' of parameter index 0 .*number"):
        opt.load_state_dict(sd)
    assert torch.equal(_v(opt, p), before)


@pytest.mark.parametrize("moments", ["q8", "fp8"])
def test_a_count_edited_in_a_written_state_or_before_a_pickle_is_converted(moments):
    """Two other ways a count edit reaches a copy of the state: a state dict entry written
    into ``optimizer.state`` (ZeroRedundancyOptimizer's load writes them) with its count
    edited, converted at the rebuild that adopts it; and a count edited in place before a
    pickle or deepcopy, whose copy builds its counters from the counts it holds. Both give the
    bits of the edit made in the optimizer."""
    p, ref = _trained_q(moments)
    ref.state[p]["step"].zero_()
    ref.settle_state()
    want = _v(ref, p)
    p1, opt = _trained_q(moments)
    entry = copy.deepcopy(opt.state_dict()["state"][0])
    entry["step"] = torch.tensor(0.0)
    opt.state[p1] = entry
    opt.init_state()  # adopts it now, as the next step would
    assert "decay_norm_step" not in opt.state[p1]
    assert torch.equal(_v(opt, p1), want)
    p2, opt = _trained_q(moments)
    opt.state[p2]["step"].zero_()
    for copied in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        (q,) = copied.param_groups[0]["params"]
        copied.settle_state()
        assert torch.equal(_v(copied, q), want)
    bad = copy.deepcopy(opt.state_dict()["state"][0])
    bad["decay_norm_step"] = torch.tensor(-3.0)
    opt.state[p2] = bad
    with pytest.raises(ConfigError, match=r"state\['decay_norm_step'\] of parameter #0 .*whole"):
        opt.init_state()


@pytest.mark.parametrize("read", ["state_dict twice", "pickle", "deepcopy", "export"])
def test_an_assigned_count_is_converted_once(read):
    """A new count put in the state (``state[p]["step"] = torch.tensor(0.)``) is converted
    when the state write is adopted, and not again by a later adoption before the rebuild:
    ``state_dict()`` twice, a pickle or deepcopy, an export, then the step or a load of the
    dict taken. Each converted the moments once more (``v`` 0.95**100 = 0.006x)."""
    checkpoint = pytest.importorskip("memopt_checkpoint")
    p, ref = _trained_q("q8")
    ref.state[p]["step"].zero_()
    ref.settle_state()
    want = _v(ref, p)
    p, opt = _trained_q("q8")
    opt.state[p]["step"] = torch.tensor(0.0)
    if read == "state_dict twice":
        opt.state_dict()
    elif read == "pickle":
        pickle.loads(pickle.dumps(opt))
    elif read == "deepcopy":
        copy.deepcopy(opt)
    else:
        checkpoint.to_torch_state_dict(opt)
    sd = copy.deepcopy(opt.state_dict())
    assert int(sd["state"][0]["step"]) == int(sd["state"][0]["decay_norm_step"]) == 0
    q = torch.nn.Parameter(p.detach().clone())
    loaded = MemOptimizer([q], lr=1e-3, betas=(0.9, 0.95), moments="q8")
    loaded.load_state_dict(sd)
    opt.init_state()  # the rebuild that adopts the write
    assert torch.equal(_v(opt, p), want)
    assert torch.equal(_v(loaded, q), want)


@pytest.mark.parametrize("bad", [float("nan"), -2.0, 0.5])
@pytest.mark.parametrize("record", [True, False], ids=["with record", "without"])
def test_a_written_state_whose_count_is_no_count_is_refused(bad, record):
    """A state dict entry written into ``optimizer.state`` with a count that is none: a
    ConfigError naming the parameter (NaN raised a bare ValueError deep in the step; a
    negative or a fraction passed)."""
    p, opt = _trained_q("q8", 5)
    entry = copy.deepcopy(opt.state_dict()["state"][0])
    entry["step"] = torch.tensor(bad)
    if not record:
        del entry["decay_norm_step"]
    opt.state[p] = entry
    p.grad = torch.randn(N)
    with pytest.raises(ConfigError, match=r"state\['step'\] of parameter #0 .*whole number >= 0"):
        opt.step()
