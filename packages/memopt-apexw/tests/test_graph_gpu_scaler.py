"""``capturable=True`` on the GPU with a ``torch.amp.GradScaler``, and the capture rules that
refuse strided tensors and parameters on several GPUs.

ApexW's graph step takes the scaler's ordinary path (its ``_step_supports_amp_scaling`` is
False): the scaler unscales the gradients in place, in the buffers the graph reads, and skips
``step()`` when it found an inf or NaN. Clean steps then give the reference's bits on the
unscaled gradients, and a skipped step changes nothing and leaves the captured graph valid."""

from __future__ import annotations

import pytest
import torch
from apexw_testutil import assert_same, make_params, reference_for, set_grads, twin

from memopt_apexw import ApexW
from memopt_core.errors import ConfigError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
STRIDED = "contiguous parameters and gradients"


def snapshot(params, opt) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    return [
        (p.detach().clone(), {k: v.clone() for k, v in opt.state.get(p, {}).items()})
        for p in params
    ]


def assert_unchanged(params, opt, before, where: str) -> None:
    for i, (p, (p0, s0)) in enumerate(zip(params, before, strict=True)):
        assert torch.equal(p, p0), f"{where}: param {i} changed"
        s = opt.state.get(p, {})
        assert sorted(s) == sorted(s0), f"{where}: param {i}: state keys {sorted(s)}"
        for k, v0 in s0.items():
            v = s[k]
            if v.dtype.is_floating_point and v.dtype.itemsize == 1:
                v, v0 = v.view(torch.uint8), v0.view(torch.uint8)
            assert torch.equal(v, v0), f"{where}: param {i}: state {k!r} changed"


# step -> (value written into one gradient element, index of that parameter): a skipped first
# step (no state yet), then two in a row after the capture
BAD = {1: (float("inf"), 1), 6: (float("inf"), 6), 7: (float("nan"), 3)}


# float32 parameters only: torch's GradScaler cannot unscale bfloat16 gradients on CUDA
# (``_amp_foreach_non_finite_check_and_unscale_cuda`` is not implemented for BFloat16)
@pytest.mark.parametrize("state", ["bf16", "q8"])
def test_grad_scaler_clean_steps_equal_reference_and_bad_steps_skip(state):
    a = make_params(CUDA)
    b = twin(a)
    opt = ApexW(a, state=state, capturable=True, mode="fused")
    ref = reference_for(b, state=state)  # steps the clean steps only, on unscaled gradients
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    taken = 0
    graph = None
    for step in range(1, 15):
        scaler.scale(torch.ones((), device=CUDA))  # what scaler.scale(loss) starts with
        scale = scaler.get_scale()
        set_grads(a, step, scale=scale)  # as if the loss had been scaled (a power of two: exact)
        set_grads(b, step)
        bad = BAD.get(step)
        if bad is not None:
            value, i = bad
            a[i].grad.view(-1)[3 if a[i].numel() > 3 else 0] = value
            before = snapshot(a, opt)
        scaler.step(opt)
        scaler.update()
        if bad is None:
            ref.step()
            taken += 1
            assert scaler.get_scale() == scale, f"step {step}: a clean step moved the scale"
        else:
            assert_unchanged(a, opt, before, f"skipped step {step}")
            assert scaler.get_scale() == scale / 2, f"step {step}: the scale did not back off"
        opt.zero_grad()
        ref.zero_grad()
        assert_same(a, b, opt, ref, f"step {step}")
        if taken:
            assert int(opt.state[a[2]]["step"]) == taken, f"step {step}"
        else:
            assert a[2] not in opt.state, "a skipped first step created state"
        if step == 5:  # steps 2 (resolved), 3 (eager warm-up), 4 (capture), 5 (replay)
            assert opt._graph is not None
            graph = opt._graph.graph
            assert graph is not None
    assert taken == 14 - len(BAD)
    assert scaler.get_scale() == 1024.0 / 2 ** len(BAD)
    assert opt._graph is not None
    assert opt._graph.graph is graph  # the skipped steps kept the captured graph valid
    assert opt._recaptures == 0
    assert {e.backend.name for e in opt._cached_steps["fused"].entries} == {"triton"}


def strided(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A (cols, rows) CUDA tensor that is a transposed view: not contiguous."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g).to(CUDA).t()


@pytest.mark.parametrize("which", ["none", "parameter", "gradient"])
def test_strided_parameter_or_gradient_is_refused_naming_its_group(which):
    a = make_params(CUDA)
    extra = make_params(CUDA, shapes=[(7, 5), (129,)], seed=3)
    if which == "parameter":
        extra[0] = strided(5, 7, 4).requires_grad_()
    opt = ApexW([{"params": a}, {"params": extra}], capturable=True, mode="fused")
    for step in range(1, 5):
        set_grads(a, step)
        set_grads(extra, step)
        if which == "gradient":
            extra[0].grad = strided(5, 7, step)
        if which == "none":  # the control: the same layout, contiguous, is captured
            opt.step()
            continue
        assert not (extra[0] if which == "parameter" else extra[0].grad).is_contiguous()
        # refused at every step: nothing was cached for a later step to replay
        with pytest.raises(ConfigError, match=rf"{STRIDED}.* param group 1 is strided"):
            opt.step()
        assert "fused" not in opt._cached_steps
        assert opt._graph is None
    if which == "none":
        assert opt._graph is not None
        assert opt._graph.graph is not None


def test_gradient_turned_strided_after_the_capture_is_refused():
    a = make_params(CUDA, shapes=[(7, 5), (129,)])
    opt = ApexW(a, capturable=True, mode="fused")
    for step in range(1, 5):
        set_grads(a, step)
        opt.step()
    assert opt._graph is not None
    assert opt._graph.graph is not None
    set_grads(a, 5)
    a[0].grad = a[0].grad.t().contiguous().t()  # the same values in a transposed layout
    assert not a[0].grad.is_contiguous()
    with pytest.raises(ConfigError, match=rf"{STRIDED}.* param group 0 is strided"):
        opt.step()
    assert opt._graph is None  # the old graph, which reads the old buffer, is gone


@pytest.mark.gpu(min_devices=2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_parameters_on_two_gpus_are_refused():
    first = make_params(torch.device("cuda", 0))
    second = make_params(torch.device("cuda", 1), shapes=[(129,), (3, 11)], seed=3)
    groups = [{"params": first}, {"params": second}]
    # the control: without a capture the same groups step on both GPUs
    plain = ApexW([{"params": twin(g["params"])} for g in groups], mode="fused")
    for g in plain.param_groups:
        set_grads(g["params"], 1)
    plain.step()
    opt = ApexW(groups, capturable=True, mode="fused")
    set_grads(first, 1)
    set_grads(second, 1)
    with pytest.raises(ConfigError, match="one CUDA graph on one device") as err:
        opt.step()
    assert "cuda:0" in str(err.value)
    assert "cuda:1" in str(err.value)
