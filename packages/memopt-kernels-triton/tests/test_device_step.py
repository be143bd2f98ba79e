"""Capturable steps (``MemOptimizer(capturable=True)``): step counts, Adam's bias corrections and
a GradScaler's scale/found-inf on the device, against the host step on core's torch backend.

Everything is compared bit for bit: parameters, every state field and the step counts. The CPU
variants run the kernels in Triton's interpreter; the CUDA variants (``gpu``) add a CUDA-graph
capture of the step.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from memopt_core import MemOptimizer, reference
from memopt_core.errors import ConfigError
from memopt_kernels_triton import ops

#: name -> (rule, master, moments, param dtype, extra hyperparameters)
CONFIGS = {
    "adamw-ecc24-q8": ("adamw", "ecc24", "q8", torch.bfloat16, {"weight_decay": 0.1}),
    "adam-l2-fp32": ("adam", "none", "fp32", torch.float32, {"weight_decay": 0.01}),
    "adamw-maximize-bf16": ("adamw", "ecc32", "bf16", torch.bfloat16, {"maximize": True}),
    "lion-ecc24-q8": ("lion", "ecc24", "q8", torch.bfloat16, {"weight_decay": 0.1, "lr": 1e-4}),
    "sgd-nesterov-fp32": (
        "sgd",
        "none",
        "fp32",
        torch.float32,
        {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
    ),
    "sgdw-momentum-ecc24-bf16": (
        "sgdw",
        "ecc24",
        "bf16",
        torch.bfloat16,
        {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
    ),
}
# Adam's 8-bit second moments are stored decay-normalized (core's StateSpec.decay_normalized):
# the words kernel computes their beta2, one_minus_beta2 and bc2_sqrt words per tensor from
# j = step % P. With these beta2 (P = 8 and 52) the steps cross periods: NORMALIZED_STEPS.
CONFIGS["adamw-ecc24-q8-beta2-0.5"] = (
    "adamw",
    "ecc24",
    "q8",
    torch.bfloat16,
    {"weight_decay": 0.1, "betas": (0.9, 0.5)},
)
CONFIGS["adam-l2-fp8-beta2-0.9"] = (
    "adam",
    "none",
    "fp8",
    torch.float32,
    {"weight_decay": 0.01, "betas": (0.8, 0.9)},
)
#: name -> the steps its tests take (more than one period of its decay normalization)
NORMALIZED_STEPS = {"adamw-ecc24-q8-beta2-0.5": 20, "adam-l2-fp8-beta2-0.9": 56}
SIZES = [(33,), (4, 8), (1,), (0,), (65,)]


def _params(dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype).to(device)) for s in SIZES]


def _optimizer(name, params, *, capturable, backend):
    rule, master, moments, _, extra = CONFIGS[name]
    kw = {"lr": 1e-2, **extra}
    return MemOptimizer(
        params,
        rule=rule,
        master=master,
        moments=moments,
        seed=7,
        capturable=capturable,
        backend=backend,
        **kw,
    )


def _host_and_device(name, device):
    """Config ``name`` on core's torch backend over CPU parameters (host counters) and on a
    capturable Triton step over the same parameters on ``device``: (ref, ref params, mine,
    device params)."""
    dtype = CONFIGS[name][3]
    ref_p, dev_p = _params(dtype, "cpu"), _params(dtype, device)
    ref = _optimizer(name, ref_p, capturable=False, backend="torch")
    return ref, ref_p, _optimizer(name, dev_p, capturable=True, backend="triton"), dev_p


def _grads(params, step, *, skip=()):
    gen = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        p.grad = None if i in skip else g.to(p.device)


def _assert_same(opt_a, params_a, opt_b, params_b, what):
    for k, (a, b) in enumerate(zip(params_a, params_b, strict=True)):
        assert torch.equal(a.detach().cpu().view(-1), b.detach().cpu().view(-1)), (
            f"{what}: parameter {k}"
        )
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert set(sa) == set(sb), what
        for key in sa:
            x, y = sa[key].detach().cpu(), sb[key].detach().cpu()
            if key == "step":
                assert float(x) == float(y), f"{what}: step of parameter {k}"
            else:
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (
                    f"{what}: {key} of parameter {k}"
                )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_capturable_equals_host_step(device, name):
    """Several steps, one of which leaves two tensors without gradients (their counts fall
    behind, so the rows of one launch hold different steps). Decay-normalized second moments
    (q8, fp8) over more than one period: the rows of one launch then also hold different
    ``j = step % P``, one of them 0 where the others are not."""
    n = NORMALIZED_STEPS.get(name, 4)
    ref, ref_p, mine, dev_p = _host_and_device(name, device)
    for step in range(1, n + 1):
        skip = (0, 3) if step == 2 else ()
        _grads(ref_p, step, skip=skip)
        _grads(dev_p, step, skip=skip)
        ref.step()
        mine.step()
        _assert_same(ref, ref_p, mine, dev_p, f"{name} step {step}")
    steps = [float(mine.state[p]["step"]) for p in dev_p]
    assert steps == [n - 1.0, n, n, n - 1.0, n]
    assert all(mine.state[p]["step"].device.type == torch.device(device).type for p in dev_p)


@pytest.mark.parametrize("name", list(NORMALIZED_STEPS))
def test_an_edited_count_on_the_device_converts_like_the_host_one(device, name):
    """Counts on the device, advanced there by the kernels, then edited in place
    (``state[p]["step"].zero_()``) and by assignment: the decay-normalized second moments are
    converted to the new counts, as for the host counters of core's torch backend, bit for
    bit, and never converted when nothing was edited (replays of the cached device step)."""
    n = NORMALIZED_STEPS[name]
    ref, ref_p, mine, dev_p = _host_and_device(name, device)
    for step in range(1, n + 9):
        skip = (0, 3) if step == 2 else ()
        _grads(ref_p, step, skip=skip)
        _grads(dev_p, step, skip=skip)
        for opt, ps in ((ref, ref_p), (mine, dev_p)):
            if step == n - 3:
                opt.state[ps[1]]["step"].zero_()
                opt.state[ps[4]]["step"].fill_(2)
            elif step == n + 4:
                opt.state[ps[2]]["step"] = torch.tensor(1.0, device=ps[2].device)
            opt.step()
        _assert_same(ref, ref_p, mine, dev_p, f"{name} step {step}")
    steps = [float(mine.state[p]["step"]) for p in dev_p]
    assert steps == [n + 7.0, 12.0, 6.0, n + 7.0, 14.0]


def test_state_dict_round_trip_keeps_counting(device):
    """Step counters survive state_dict/load_state_dict (they are rebuilt as device views)."""
    ref_p, dev_p = _params(torch.bfloat16, "cpu"), _params(torch.bfloat16, device)
    ref = _optimizer("adamw-ecc24-q8", ref_p, capturable=False, backend="torch")
    mine = _optimizer("adamw-ecc24-q8", dev_p, capturable=True, backend="triton")
    for step in (1, 2):
        _grads(ref_p, step)
        _grads(dev_p, step)
        ref.step()
        mine.step()
    sd = mine.state_dict()
    fresh = _optimizer("adamw-ecc24-q8", dev_p, capturable=True, backend="triton")
    fresh.load_state_dict(sd)
    for step in (3, 4):
        _grads(ref_p, step)
        _grads(dev_p, step)
        ref.step()
        fresh.step()
    _assert_same(ref, ref_p, fresh, dev_p, "after load_state_dict")


def _scaled_steps(params, opt, scaler, device, n, bad_step):
    """``n`` iterations of a GradScaler loop on a quadratic loss; step ``bad_step``'s gradient
    holds an inf."""
    for step in range(1, n + 1):
        opt.zero_grad()
        gen = torch.Generator().manual_seed(step)
        targets = [torch.randn(p.shape, generator=gen).to(device) for p in params]
        loss = sum(((p.float() - t) ** 2).sum() for p, t in zip(params, targets, strict=True))
        scaler.scale(loss).backward()
        if step == bad_step:
            params[0].grad.view(-1)[0] = math.inf
        scaler.step(opt)
        scaler.update()


class _ScalerLoop(MemOptimizer):
    """A MemOptimizer as GradScaler treats an optimizer without in-kernel scaling: its ordinary
    loop (``unscale_``, a host read of the found-inf flag, ``step()`` skipped on an inf)."""

    _step_supports_amp_scaling = False


def test_scaled_steps_replay_a_cached_device_step(device, monkeypatch):
    """GradScaler steps without ``capturable`` cache their device works and replay them (no new
    prepared launch while the tensors stay): the same bits as the scaler's own loop over the
    host step, with two param groups, through an lr change, gradients in new buffers, a host
    step in between (the counts go back to the host, the cached device step is dropped) and
    an inf step."""
    from memopt_kernels_triton import ops

    prepared = []
    real = ops.prepare_step
    monkeypatch.setattr(ops, "prepare_step", lambda *a, **k: prepared.append(1) or real(*a, **k))
    rule, master, moments, dtype, extra = CONFIGS["adam-l2-fp32"]
    ref_p, dev_p = _params(dtype, "cpu"), _params(dtype, device)

    def build(cls, params, backend):
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 5e-3}]
        return cls(
            groups, rule=rule, master=master, moments=moments, seed=7, backend=backend,
            **{"lr": 1e-2, **extra},
        )  # fmt: skip

    ref, mine = build(_ScalerLoop, ref_p, "torch"), build(MemOptimizer, dev_p, "triton")
    scalers = [
        torch.amp.GradScaler(kind, init_scale=2.0**10, growth_interval=3)
        for kind in ("cpu", torch.device(device).type)
    ]
    for it in range(1, 13):
        if it == 5:
            for opt in (ref, mine):
                opt.param_groups[1]["lr"] = 1e-3
        before = len(prepared)
        for params, opt, scaler, dev in zip(
            (ref_p, dev_p), (ref, mine), scalers, ("cpu", device), strict=True
        ):
            opt.zero_grad(set_to_none=it in (6, 7))  # new gradient buffers at 6 and 7
            gen = torch.Generator().manual_seed(it)
            targets = [torch.randn(p.shape, generator=gen).to(dev) for p in params]
            loss = sum(((p - t) ** 2).sum() for p, t in zip(params, targets, strict=True))
            if it == 9:  # a step without the scaler: the counts go back to the host
                loss.backward()
                opt.step()
                continue
            scaler.scale(loss).backward()
            if it == 11:
                params[4].grad.view(-1)[0] = math.inf
            scaler.step(opt)
            scaler.update()
        _assert_same(ref, ref_p, mine, dev_p, f"iteration {it}")
        if it in (3, 4, 12):  # replays over the buffers the cached step was prepared for
            assert len(prepared) == before, f"iteration {it} prepared its launches again"
    assert scalers[0].get_scale() == scalers[1].get_scale()
    assert float(mine.state[dev_p[4]]["step"]) == 11.0  # 12 iterations, one skipped


def _grads_into(params, step, *, skip=()):
    """:func:`_grads`' values, copied into the gradient buffers the parameters already have
    (a CUDA graph's loop), a skipped one set to None."""
    gen = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        if i in skip:
            p.grad = None
        elif p.grad is None:
            p.grad = g.to(p.device)
        else:
            p.grad.copy_(g)


def test_capturable_steps_replay_a_cached_step(device, monkeypatch):
    """Eager capturable steps cache their works and replay them while the tensors stay (no new
    prepared launch): the same bits as the host step, with two param groups, through an lr
    change, gradients in new buffers (followed by preparing again, which caches their tables:
    an ordinary step over the same buffers, what a CUDA graph captures, then copies nothing) and
    a step that leaves two tensors without gradients (their counts fall behind: resolved anew,
    then replayed)."""
    from memopt_kernels_triton import ops

    prepared, copies = [], []
    real_prepare, real_copy = ops.prepare_step, ops._to_device
    monkeypatch.setattr(
        ops, "prepare_step", lambda *a, **k: prepared.append(1) or real_prepare(*a, **k)
    )
    monkeypatch.setattr(ops, "_to_device", lambda *a: copies.append(1) or real_copy(*a))
    rule, master, moments, dtype, extra = CONFIGS["adamw-ecc24-q8"]
    ref_p, dev_p = _params(dtype, "cpu"), _params(dtype, device)

    def build(params, capturable, backend):
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 5e-3}]
        return MemOptimizer(
            groups, rule=rule, master=master, moments=moments, seed=7, capturable=capturable,
            backend=backend, **{"lr": 1e-2, **extra},
        )  # fmt: skip

    ref, mine = build(ref_p, False, "torch"), build(dev_p, True, "triton")
    for it in range(1, 13):
        if it == 5:
            for opt in (ref, mine):
                opt.param_groups[1]["lr"] = 1e-3
        skip = (0, 3) if it == 8 else ()
        before, copied = len(prepared), len(copies)
        for params in (ref_p, dev_p):
            if it in (6, 7):  # new gradient buffers
                _grads(params, it, skip=skip)
            else:
                _grads_into(params, it, skip=skip)
        ref.step()
        mine.step()
        _assert_same(ref, ref_p, mine, dev_p, f"iteration {it}")
        if it in (3, 4, 5, 11, 12):  # replays over the buffers they were prepared for
            assert len(prepared) == before, f"iteration {it} prepared its launches again"
            assert len(copies) == copied, f"iteration {it} copied tables from the host"
        if it in (6, 7):
            assert len(prepared) > before, f"iteration {it}: moved gradients were not followed"
    assert [float(mine.state[p]["step"]) for p in dev_p] == [11.0, 12.0, 12.0, 11.0, 12.0]
    # the ordinary step over the buffers the replays followed finds every table cached
    mine._drop_cached_steps()
    copied = len(copies)
    for params in (ref_p, dev_p):
        _grads_into(params, 13)
    ref.step()
    mine.step()
    _assert_same(ref, ref_p, mine, dev_p, "the ordinary step after the replays")
    assert len(copies) == copied, "the ordinary step copied tables the replays did not cache"


@pytest.mark.parametrize("capturable", [True, False], ids=["capturable", "default"])
@pytest.mark.parametrize("scale", [2.0**12, 1000.0])
@pytest.mark.parametrize("name", ["adamw-ecc24-q8", "adam-l2-fp32", "lion-ecc24-q8"])
def test_grad_scaler_in_kernel(device, name, scale, capturable, monkeypatch):
    """GradScaler with the Triton backend (scale and found-inf consumed on the device, with
    ``capturable`` and without it) equals the ordinary GradScaler loop (unscale_, .item(),
    skip) of the host step: same parameters, states, step counts (the inf step is skipped) and
    scale. A scale that is not a power of two: unscale_ rounds bf16 gradients after the
    multiply, and so must the kernel (it had kept the fp32 product: 1 of 40 bf16 weights
    differed after 3 steps)."""
    import memopt_core.optimizer as core_optimizer

    dtype = CONFIGS[name][3]
    if dtype == torch.bfloat16 and torch.device(device).type == "cuda":
        # GradScaler.step itself checks the gradients with a torch kernel that has no bf16
        # variant on CUDA (fp32 parameters under fp16 autocast are its use; ecc's tests run one)
        pytest.skip("torch's GradScaler cannot check bf16 gradients on CUDA")

    def on_host(*args):
        raise AssertionError("the scaler's flags were read on the host")

    # the kernel reads them: unscaling on the host instead would give the same bits
    monkeypatch.setattr(core_optimizer, "_unscale_on_host", on_host)
    ref_p, dev_p = _params(dtype, "cpu"), _params(dtype, device)
    rule, master, moments, _, extra = CONFIGS[name]
    ref = _ScalerLoop(
        ref_p, rule=rule, master=master, moments=moments, seed=7, backend="torch",
        **{"lr": 1e-2, **extra},
    )  # fmt: skip
    mine = _optimizer(name, dev_p, capturable=capturable, backend="triton")
    assert mine._step_supports_amp_scaling
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=2)
    dev_scaler = torch.amp.GradScaler(
        torch.device(device).type, init_scale=scale, growth_interval=2
    )
    _scaled_steps(ref_p, ref, ref_scaler, "cpu", 5, bad_step=3)
    _scaled_steps(dev_p, mine, dev_scaler, device, 5, bad_step=3)
    _assert_same(ref, ref_p, mine, dev_p, f"{name} with GradScaler")
    assert float(mine.state[dev_p[1]]["step"]) == 4.0  # 5 iterations, one skipped
    assert mine.state[dev_p[1]]["step"].device == dev_p[1].device  # counted where it ran
    assert ref_scaler.get_scale() == dev_scaler.get_scale()
    # without the scaler the counts go back to the host and the steps stay equal
    for step in (6, 7):
        _grads(ref_p, step)
        _grads(dev_p, step)
        ref.step()
        mine.step()
    _assert_same(ref, ref_p, mine, dev_p, f"{name} after the GradScaler steps")
    if not capturable:
        assert mine.state[dev_p[1]]["step"].device.type == "cpu"


@pytest.mark.parametrize("moments", ["fp32", "q8", "fp8"])
def test_words_follow_core_scalars(device, moments):
    """The device words equal the host's ``hyper_words`` of core's ``adam_scalars`` at each
    tensor's own step, including steps at and past the end of the bias table. With the 8-bit
    moments (decay-normalized, ``adam_scalars(normalized=True)``) also at the steps where
    ``j = step % P`` is 0, P - 1 and 1, before and past the end of the table."""
    from memopt_kernels_triton import ops

    betas = (0.5, 0.75)  # a short table: every step past 'last' reads its last entry
    last = len(reference.adam_bias_table(*betas)[0]) - 1
    counts = [0.0, 1.0, 6.0, float(last - 1), float(last), float(last + 40)]
    normalized = moments != "fp32"
    if normalized:
        period = reference.decay_norm_period(betas[1])
        assert 1 < period < last  # 19 and 133
        beyond = period * (last // period + 2)  # a multiple of P past 'last'
        counts += [float(k - 1) for k in (period - 1, period, period + 1, 2 * period)]
        counts += [float(k - 1) for k in (beyond - 1, beyond, beyond + 1)]
    params = [torch.nn.Parameter(torch.zeros(3, device=device)) for _ in counts]
    for lr in (1e-3, 0.1 / 3, 7.5e-6):
        opt = MemOptimizer(
            params,
            rule="adamw",
            lr=lr,
            betas=betas,
            weight_decay=0.1,
            seed=9,
            moments=moments,
            capturable=True,
            backend="triton",
        )
        opt.init_state()
        for p, c in zip(params, counts, strict=True):
            opt.state[p]["step"] = torch.tensor(c)
            p.grad = torch.zeros_like(p)
        opt.step()
        entry = opt._plans[0].entries[0]
        words = entry.plan.cache(("triton_device_words", "adam"), None).cpu().tolist()
        count_of = {id(p): c for p, c in zip(params, counts, strict=True)}
        for si, p in enumerate(entry.owners):
            k = int(count_of[id(p)]) + 1
            s = reference.adam_scalars(
                lr=lr,
                betas=betas,
                eps=1e-8,
                weight_decay=0.1,
                step=k,
                decoupled=True,
                normalized=normalized,
            )
            assert words[si] == ops.adam_hyper_words(s, 9, k), (lr, k)
            assert float(opt.state[p]["step"]) == k


def test_capturable_errors(device):
    p = [torch.nn.Parameter(torch.zeros(4, device=device))]
    with pytest.raises(ConfigError, match="capturable must be True or False"):
        MemOptimizer(p, capturable=1)
    with pytest.raises(ConfigError, match="exclude each other"):
        MemOptimizer(p, capturable=True, check_numerics=True)
    opt = MemOptimizer(p, capturable=True, backend="torch")
    p[0].grad = torch.ones_like(p[0])
    with pytest.raises(ConfigError, match="capturable=True needs a backend that keeps step"):
        opt.step()
    assert torch.equal(p[0].detach().cpu(), torch.zeros(4))
    opt = MemOptimizer(p, betas=(0.9, 0.9999999), capturable=True, backend="triton")
    with pytest.raises(ConfigError, match="limit of device step counters"):
        opt.step()


def test_bias_table_matches_adam_scalars():
    for betas in ((0.9, 0.999), (0.0, 0.5), (0.95, 0.0)):
        bc1, bc2 = reference.adam_bias_table(*betas)
        last = len(bc1) - 1
        assert bc1[last] == 1.0
        assert bc2[last] == 1.0
        for k in [1, 2, 3, 10, last - 1, last, last + 1, 10 * last + 7]:
            s = reference.adam_scalars(
                lr=0.3, betas=betas, eps=1e-8, weight_decay=0.0, step=k, decoupled=True
            )
            j = min(k, last)
            assert s.step_size == 0.3 / bc1[j]
            assert s.bc2_sqrt == bc2[j]
    with pytest.raises(ValueError, match="betas must lie in"):
        reference.adam_bias_table(1.0, 0.9)


def test_normalized_table_matches_adam_scalars(monkeypatch):
    """The words a decay-normalized device step reads from its table (``bc2_sqrt`` at every
    step up to the end of the bias table and one period past it, ``one_minus_beta2`` at every
    ``j``) and the ``beta2`` word it is given are ``adam_scalars(normalized=True)``'s, rounded
    to fp32; the table is cached with the bias tables (bounded, built once)."""
    monkeypatch.setattr(ops, "_BIAS_TABLES", {})
    monkeypatch.setattr(ops, "_BIAS_CAPTURED", set())
    dev = torch.device("cpu")
    for betas in ((0.9, 0.999), (0.9, 0.5), (0.0, 0.75), (0.9, 0.0), (0.5, 0.003)):
        _, table, last = ops._bias_tables(dev, betas, True)
        assert ops._bias_tables(dev, betas, True)[1] is table
        period, _, _ = reference.decay_norm_table(betas[1])
        assert table.shape == (last + 1 + 2 * period,)
        bits = table.tolist()
        for k in range(1, last + period + 1):
            s = reference.adam_scalars(
                lr=0.1, betas=betas, eps=1e-8, weight_decay=0.0, step=k, decoupled=True,
                normalized=True,
            )  # fmt: skip
            j = k % period
            at = k if k <= last else last + 1 + j
            assert bits[at] == ops._f32_bits(s.bc2_sqrt), (betas, k)
            assert bits[last + 1 + period + j] == ops._f32_bits(s.one_minus_beta2), (betas, k)
            b2 = ops._f32_bits(betas[1] ** period) if j == 0 else ops._f32_bits(1.0)
            assert b2 == ops._f32_bits(s.beta2), (betas, k)
            assert s.bc2_sqrt <= 16.0  # kernels.division.divisor_in_range's bound
    assert len(ops._BIAS_TABLES) <= ops._BIAS_KEEP


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "name",
    [
        "adamw-ecc24-q8",
        "adamw-ecc24-q8-beta2-0.5",
        "adam-l2-fp8-beta2-0.9",
        "lion-ecc24-q8",
        "sgd-nesterov-fp32",
    ],
)
def test_cuda_graph_replay_equals_eager(name):
    """Capture ``opt.step()`` in a CUDA graph after one eager step; replaying it with new
    gradients copied into the same buffers gives the eager capturable step's bits, and those
    equal the host step's."""
    import os

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("GPU tests compile kernels: unset TRITON_INTERPRET")
    dtype = CONFIGS[name][3]
    ref_p, eager_p, graph_p = (_params(dtype, "cuda") for _ in range(3))
    ref = _optimizer(name, ref_p, capturable=False, backend="triton")
    eager = _optimizer(name, eager_p, capturable=True, backend="triton")
    graphed = _optimizer(name, graph_p, capturable=True, backend="triton")
    for p in graph_p:
        p.grad = torch.zeros_like(p)
    graph = None
    for step in range(1, NORMALIZED_STEPS.get(name, 6) + 1):
        _grads(ref_p, step)
        _grads(eager_p, step)
        gen = torch.Generator().manual_seed(1000 + step)
        for p in graph_p:
            p.grad.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
        ref.step()
        eager.step()
        if step == 1:
            graphed.step()  # builds tables and counters
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                graphed.step()
            torch.cuda.current_stream().wait_stream(stream)
            # capturing recorded the launches without running them
        else:
            graph.replay()
        torch.cuda.synchronize()
        _assert_same(ref, ref_p, eager, eager_p, f"{name} eager step {step}")
        _assert_same(ref, ref_p, graphed, graph_p, f"{name} graph step {step}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_captured_after_replays_over_moved_gradients():
    """Eager capturable steps replayed over gradients in new buffers at every step (the cached
    step follows them), then a CUDA graph captured over the last step's buffers: the capture
    copies nothing from the host (it would raise), and its replays give the host step's bits.
    Two param groups of one family: the capture merges them into one launch."""
    import os

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("GPU tests compile kernels: unset TRITON_INTERPRET")
    rule, master, moments, dtype, extra = CONFIGS["adamw-ecc24-q8"]
    ref_p, dev_p = _params(dtype, "cpu"), _params(dtype, "cuda")

    def build(params, capturable, backend):
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 5e-3}]
        return MemOptimizer(
            groups, rule=rule, master=master, moments=moments, seed=7, capturable=capturable,
            backend=backend, **{"lr": 1e-2, **extra},
        )  # fmt: skip

    ref, mine = build(ref_p, False, "torch"), build(dev_p, True, "triton")
    graph = None
    for step in range(1, 8):
        _grads(ref_p, step)
        ref.step()
        if step <= 4:  # new buffers at every step, eager
            _grads(dev_p, step)
            mine.step()
        else:
            _grads_into(dev_p, step)
            graph.replay()
        if step == 4:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                mine.step()
            torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        _assert_same(ref, ref_p, mine, dev_p, f"step {step}")


@pytest.mark.parametrize("capturable", [True, False], ids=["capturable", "default"])
def test_step_parameters_found_inf_skips_on_the_device(device, capturable):
    """``step_parameters(found_inf=...)`` (gradient release with a GradScaler): a nonzero flag
    leaves the tensor, its state and its count as they were; a zero flag steps it as the host
    step does."""
    ref_p, dev_p = _params(torch.bfloat16, "cpu"), _params(torch.bfloat16, device)
    ref = _optimizer("adamw-ecc24-q8", ref_p, capturable=False, backend="torch")
    mine = _optimizer("adamw-ecc24-q8", dev_p, capturable=capturable, backend="triton")
    one = torch.ones(1, device=device)
    zero = torch.zeros(1, device=device)
    for step in (1, 2):
        _grads(ref_p, step)
        _grads(dev_p, step)
        ref.step()
        mine.step()
    before = [p.detach().clone() for p in dev_p]
    codes = [mine.state[p]["master_code"].clone() for p in dev_p]
    _grads(dev_p, 3)
    mine.step_parameters([dev_p[0], dev_p[4]], found_inf=one)
    for k, p in enumerate(dev_p):
        assert torch.equal(p.detach(), before[k])
        assert torch.equal(mine.state[p]["master_code"], codes[k])
        assert float(mine.state[p]["step"]) == 2.0
    _grads(ref_p, 3)
    ref.step_parameters([ref_p[0], ref_p[4]])
    mine.step_parameters([dev_p[0], dev_p[4]], found_inf=zero)
    _assert_same(ref, ref_p, mine, dev_p, "after a skipped and a taken step_parameters")
    assert float(mine.state[dev_p[0]]["step"]) == 3.0
    # the torch backend has no device steps: it reads the flag on the host
    ref.step_parameters([ref_p[0]], found_inf=torch.ones(1))
    _assert_same(ref, ref_p, mine, dev_p, "after a step_parameters skipped on the host")
    with pytest.raises(ConfigError, match="one-element float32 tensor"):
        mine.step_parameters([dev_p[0]], found_inf=torch.zeros(2, device=device))


@pytest.mark.parametrize("decouple_lr", [False, True], ids=["lr", "decouple_lr"])
@pytest.mark.parametrize(
    "name",
    [
        "adamw-ecc24-q8",
        "lion-ecc24-q8",
        "sgdw-momentum-ecc24-bf16",
        "sgd-nesterov-fp32",
        "adam-l2-fp32",
    ],
)
def test_tensor_lr_on_the_device_is_read_at_every_step(device, name, decouple_lr):
    """A one-element tensor lr on the group's device, changed in place between steps (as
    torch's LR schedulers ``fill_`` a tensor lr), is read by the words kernel at each step:
    Adam's step size, Lion's and SGD's lr word and the decoupled decay factor (with
    ``decouple_lr``, against the initial lr recorded when the group was added) equal the host
    step's with the same float lr, bit for bit."""
    dtype = CONFIGS[name][3]
    rule, master, moments, _, extra = CONFIGS[name]
    kw = {**extra, "decouple_lr": decouple_lr}
    kw.pop("lr", None)
    lr0 = 1e-3 if rule != "lion" else 1e-4
    ref_p, dev_p = _params(dtype, "cpu"), _params(dtype, device)
    ref = MemOptimizer(
        ref_p, rule=rule, master=master, moments=moments, seed=7, backend="torch", lr=lr0, **kw
    )
    lr = torch.tensor(lr0, dtype=torch.float64, device=device)
    mine = MemOptimizer(
        dev_p, rule=rule, master=master, moments=moments, seed=7, capturable=True,
        backend="triton", lr=lr, **kw,
    )  # fmt: skip
    # an lr that moves every step, and the float32 value a float32 tensor would hold
    for step, factor in enumerate([1.0, 0.5, 3.0, 0.1 / 3], start=1):
        value = lr0 * factor
        lr.fill_(value)
        ref.param_groups[0]["lr"] = value
        _grads(ref_p, step)
        _grads(dev_p, step)
        ref.step()
        mine.step()
        _assert_same(ref, ref_p, mine, dev_p, f"{name} step {step} (lr {value})")
    assert mine.param_groups[0]["lr"] is lr  # read in place, never replaced


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (a -0 differs from +0 here, unlike ``torch.equal``)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


@pytest.mark.parametrize(
    "name",
    [
        "adamw-ecc24-q8",
        "adam-l2-fp32",
        "lion-ecc24-q8",
        "sgd-nesterov-fp32",
        "sgdw-momentum-ecc24-bf16",
    ],
)
def test_tensor_weight_decay_on_the_device_is_read_at_every_step(device, name):
    """A one-element weight decay tensor on the group's device, changed in place between steps,
    is read by the words kernel at each step: the decoupled decay factor (AdamW, Lion, SGDW) or
    the L2 coefficient (Adam, SGD) equal the host step's with the same float, bit for bit. At
    a weight decay of 0 the L2 term is left out as the host step leaves it out: gradients of
    -0 stay -0 (``g + 0 * p`` would make them +0 where ``p > 0``, and a moment's zero would
    change sign)."""
    rule, master, moments, dtype, extra = CONFIGS[name]
    wd0 = extra["weight_decay"]
    kw = {"lr": extra.get("lr", 1e-2), **{k: v for k, v in extra.items() if k != "lr"}}
    ref_p, dev_p = _params(dtype, "cpu"), _params(dtype, device)
    ref = MemOptimizer(
        ref_p, rule=rule, master=master, moments=moments, seed=7, backend="torch", **kw
    )
    wd = torch.tensor(wd0, dtype=torch.float64, device=device)
    mine = MemOptimizer(
        dev_p, rule=rule, master=master, moments=moments, seed=7, capturable=True,
        backend="triton", **{**kw, "weight_decay": wd},
    )  # fmt: skip
    # 0 first: a zero moment (or momentum buffer) keeps the sign of a -0 gradient
    for step, value in enumerate([0.0, wd0, 3 * wd0, 0.0, wd0 / 7], start=1):
        wd.fill_(value)
        ref.param_groups[0]["weight_decay"] = value
        for params in (ref_p, dev_p):
            _grads(params, step)
            for p in params:
                p.grad.view(-1)[::3] = -0.0
        ref.step()
        mine.step()
        what = f"{name} step {step} (weight decay {value})"
        for k, (a, b) in enumerate(zip(ref_p, dev_p, strict=True)):
            assert torch.equal(_bits(a), _bits(b)), f"{what}: parameter {k}"
            for key, x in ref.state[a].items():
                if key != "step":
                    assert torch.equal(_bits(x), _bits(mine.state[b][key])), f"{what}: {key} {k}"
    assert mine.param_groups[0]["weight_decay"] is wd  # read in place, never replaced


def test_a_tensor_lr_on_another_device_is_read_as_a_float(device):
    """The words kernel reads a tensor lr only on the group's device; elsewhere (a CPU tensor
    for a GPU group) the host reads it, as a float; one of several elements is refused."""
    from memopt_kernels_triton import ops

    assert ops._device_scalar(None, "lr", torch.device(device)) is None
    assert ops._device_scalar(1e-3, "lr", torch.device(device)) is None
    t = ops._device_scalar(torch.tensor(0.5, dtype=torch.float32), "lr", torch.device("cpu"))
    assert t.dtype == torch.float64
    assert float(t) == 0.5
    with pytest.raises(ConfigError, match="one-element floating-point tensor"):
        ops._device_scalar(torch.ones(2, device=device), "device_step.lr", torch.device(device))
    with pytest.raises(ConfigError, match="one-element floating-point tensor"):
        ops._device_scalar(torch.tensor(1, device=device), "device_step.lr", torch.device(device))


def test_bias_tables_of_cycled_betas_are_bounded_and_per_beta(monkeypatch):
    """OneCycleLR writes a new beta1 at every step: each (beta1, beta2) pair kept a new pair
    of 38,000-entry device tables forever (62 MiB over 150 steps on an H100, and 28 ms of
    host work per step). The tables are cached per beta, a bounded number of them besides
    those a capture read, with core's bits."""
    monkeypatch.setattr(ops, "_BIAS_TABLES", {})
    monkeypatch.setattr(ops, "_BIAS_CAPTURED", set())
    dev = torch.device("cpu")
    bc2_first = None
    for i in range(3 * ops._BIAS_KEEP):
        beta1 = 0.85 + i * 1e-3
        bc1, bc2, last = ops._bias_tables(dev, (beta1, 0.999))
        want1, want2 = reference.adam_bias_table(beta1, 0.999)
        assert last == len(want1) - 1
        assert bc1.tolist() == list(want1)
        assert bc2.tolist() == [struct.unpack("<i", struct.pack("<f", v))[0] for v in want2]
        bc2_first = bc2 if bc2_first is None else bc2_first
        assert bc2 is bc2_first  # beta2's table is built once
        assert len(ops._BIAS_TABLES) <= ops._BIAS_KEEP


@pytest.mark.parametrize("field", ["steps", "norm_steps"])
@pytest.mark.parametrize(
    "bad",
    [
        lambda d: torch.zeros(4, dtype=torch.float64, device=d),
        lambda d: torch.zeros(3, device=d),
        lambda d: torch.zeros(8, device=d)[::2],
        lambda d: [0.0] * 4,
    ],
    ids=["float64", "short", "strided", "list"],
)
def test_bad_device_counts_are_refused_before_any_launch(device, field, bad):
    """A capturable step's counters (``steps``) and the record of the counts its second
    moments are stored for (``norm_steps``) must each be a contiguous float32 tensor of one
    count per plan slot on the group's device: anything else is refused, naming the field."""
    from memopt_core.backends import DeviceStep
    from memopt_core.formats import StateSpec
    from memopt_core.testing import group_step, make_grads, make_group

    group = make_group("adamw", StateSpec(moments="q8"), torch.float32, [33, 1, 64, 7], device)
    work = group_step(group, make_grads(group, 1), 1)
    steps = torch.zeros(4, device=device)
    counts = {"steps": steps, "norm_steps": steps.clone()}
    counts[field] = bad(device)
    work.device_step = DeviceStep(lr=1e-3, betas=(0.9, 0.999), normalized=True, **counts)
    before = [p.clone() for p in group.params]
    with pytest.raises(ConfigError, match=f"device_step.{field} must be a contiguous float32"):
        ops.fused_step(work)
    assert all(torch.equal(a, b) for a, b in zip(before, group.params, strict=True))
    assert torch.equal(steps, torch.zeros(4, device=device))
