"""A ``torch.amp.GradScaler`` hands every MemOptimizer without ``check_numerics`` its scale and
found-inf flag (torch's ``_step_supports_amp_scaling`` protocol, as for torch's fused AdamW), so
the scaler neither unscales nor reads the flag itself. On a backend without device steps (core's
torch backend here) the optimizer does what the scaler's own loop does: the same bits, scale
included. The in-kernel path (Triton) is tested in memopt-kernels-triton's
``test_device_step.py``."""

from __future__ import annotations

import math

import pytest
import torch
from test_cached_step import backend_names

from memopt_core import MemOptimizer
from memopt_core.testing import bits


class _ScalerLoop(MemOptimizer):
    """The scaler's ordinary loop: ``unscale_``, a host read of found-inf, ``step()`` skipped."""

    _step_supports_amp_scaling = False


def _train(cls, steps, bad_steps, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 5))
    opt = cls(model.parameters(), **{"backend": "torch", "seed": 3, **kw})
    # growth_interval 3: the scale grows and backs off within the run
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=3)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = model(x).square().mean() * (1 + step % 3)
        scaler.scale(loss).backward()
        if step in bad_steps:
            model[0].weight.grad.view(-1)[step] = math.inf
        scaler.step(opt)
        scaler.update()
    return model, opt, scaler


@pytest.mark.parametrize(
    "kw",
    [
        {"rule": "adamw", "moments": "bf16", "weight_decay": 0.1},
        {"rule": "lion", "moments": "q8", "lr": 1e-4},
        {"rule": "sgd", "momentum": 0.9, "lr": 1e-2},
    ],
    ids=["adamw-bf16", "lion-q8", "sgd-momentum"],
)
def test_scaler_flags_on_a_host_backend_equal_the_scaler_loop(kw):
    """40 iterations with three non-finite ones: parameters, every state field, the step
    counts (the inf steps are skipped) and the final scale equal the scaler's own loop."""
    bad = {4, 5, 17}
    m_ref, ref, s_ref = _train(_ScalerLoop, 40, bad, **kw)
    m_mine, mine, s_mine = _train(MemOptimizer, 40, bad, **kw)
    assert mine._step_supports_amp_scaling
    assert not ref._step_supports_amp_scaling
    for a, b in zip(m_ref.parameters(), m_mine.parameters(), strict=True):
        assert torch.equal(a, b)
        sa, sb = ref.state[a], mine.state[b]
        assert set(sa) == set(sb)
        for key in sa:
            assert torch.equal(
                sa[key].view(-1).view(torch.uint8), sb[key].view(-1).view(torch.uint8)
            ), key
        assert float(sb["step"]) == 37.0
    assert s_ref.get_scale() == s_mine.get_scale()


@pytest.mark.parametrize("backend", backend_names())
def test_a_host_step_reads_found_inf_once(backend, monkeypatch):
    """On a backend without device steps the optimizer reads the scaler's found-inf flag on
    the host: once per step (on CUDA each read is a device synchronisation; the step read it
    twice, once to skip the works and once more before unscaling). 8 iterations, two of them
    non-finite: the same bits as the scaler's own loop."""
    bad = {3, 6}
    kw = {"rule": "adamw", "moments": "q8", "backend": backend}
    m_ref, ref, _ = _train(_ScalerLoop, 8, bad, **kw)
    flags: list[torch.Tensor] = []  # each step's flag, as the scaler hands it over
    reads: list[int] = []  # the iteration of each flag read
    real_step, real_item = MemOptimizer.step, torch.Tensor.item

    def step(self, *args, **kwargs):
        flags.append(self.found_inf)
        return real_step(self, *args, **kwargs)

    def item(self):
        reads.extend(i for i, f in enumerate(flags, start=1) if f is self)
        return real_item(self)

    monkeypatch.setattr(MemOptimizer, "step", step)
    monkeypatch.setattr(torch.Tensor, "item", item)
    m_mine, mine, _ = _train(MemOptimizer, 8, bad, **kw)
    monkeypatch.undo()
    assert reads == list(range(1, 9))
    assert [float(f) for f in flags] == [float(i in bad) for i in range(1, 9)]
    for a, b in zip(m_ref.parameters(), m_mine.parameters(), strict=True):
        assert torch.equal(a, b)
        for key in ref.state[a]:
            assert torch.equal(bits(ref.state[a][key]), bits(mine.state[b][key])), key
        assert float(mine.state[b]["step"]) == 6.0


def test_check_numerics_leaves_the_flags_to_the_scaler():
    """With check_numerics the scaler keeps its own loop: the optimizer would otherwise see
    (and refuse) the non-finite gradients of the steps the scaler skips."""
    p = [torch.nn.Parameter(torch.ones(4))]
    assert not MemOptimizer(p, check_numerics=True)._step_supports_amp_scaling
    _, opt, _ = _train(MemOptimizer, 6, {3}, rule="adamw", check_numerics=True)
    assert float(opt.state[next(iter(opt.state))]["step"]) == 5.0


def test_step_parameters_reads_found_inf_on_the_host():
    """``step_parameters(found_inf=...)`` on a backend without device steps: a nonzero flag
    changes nothing, a zero one steps as without it."""
    a = [torch.nn.Parameter(torch.linspace(-1, 1, 33))]
    b = [torch.nn.Parameter(torch.linspace(-1, 1, 33))]
    ref = MemOptimizer(a, rule="adamw", moments="bf16", backend="torch")
    mine = MemOptimizer(b, rule="adamw", moments="bf16", backend="torch")
    a[0].grad = torch.full((33,), 0.5)
    b[0].grad = torch.full((33,), 0.5)
    mine.step_parameters(b, found_inf=torch.ones(1))
    assert torch.equal(b[0], torch.linspace(-1, 1, 33))
    assert not mine.state or float(mine.state[b[0]]["step"]) == 0.0
    ref.step_parameters(a)
    mine.step_parameters(b, found_inf=torch.zeros(1))
    assert torch.equal(a[0], b[0])
    assert torch.equal(ref.state[a[0]]["exp_avg"], mine.state[b[0]]["exp_avg"])
    assert float(mine.state[b[0]]["step"]) == 1.0


def test_a_refused_step_leaves_no_scaler_flags_behind():
    """GradScaler.step deletes the optimizer's grad_scale / found_inf only after a step that
    returns: after a refused one (a bad lr, refused before any change) the next scaler.step
    unscaled by the square of the scale. The iteration whose step was refused must be a
    skipped one: two good iterations after it give the bits of two plain ones."""

    def run(refuse_first):
        p = torch.nn.Parameter(torch.ones(64))
        opt = MemOptimizer([p], rule="sgd", lr=0.1, backend="torch", seed=3)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
        for it in range(3 if refuse_first else 2):
            opt.zero_grad()
            scaler.scale((p * torch.arange(64.0)).sum() * 1e-3).backward()
            if refuse_first and it == 0:
                opt.param_groups[0]["lr"] = -1.0
                with pytest.raises(ValueError, match="learning rate"):
                    scaler.step(opt)
                opt.param_groups[0]["lr"] = 0.1
                assert not hasattr(opt, "grad_scale")
                assert not hasattr(opt, "found_inf")
            else:
                scaler.step(opt)
            scaler.update()
        return p.detach()

    want = run(False)
    assert not torch.equal(want, torch.ones(64))
    assert torch.equal(run(True), want)
