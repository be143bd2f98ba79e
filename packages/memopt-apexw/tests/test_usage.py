"""ApexW as users drive it: clear errors for bad configurations, state bytes, GradScaler,
closures, pickling, and bf16 moments that keep decaying over thousands of steps."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from apexw_testutil import (
    assert_same,
    fused_backend_for,
    make_params,
    reference_for,
    set_cpu_backend,
    set_grads,
    triton_interpreter_ready,
    twin,
)

from memopt_apexw import ApexW, state_bytes_per_param
from memopt_apexw.auto_mode import TIMED_ROUNDS, WARMUP_STEPS
from memopt_core import MemOptimizer
from memopt_core.errors import BackendUnavailableError, ConfigError, StateDictError


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"amsgrad": True}, "amsgrad=True"),
        ({"amsgrad": 1}, "amsgrad must be True or False"),
        ({"state": "fp32"}, "state must be one of"),
        ({"master": "none"}, "master must be one of"),
        ({"mode": "fast"}, "mode must be one of"),
        ({"capturable": "yes"}, "capturable must be True or False"),
        ({"capturable": True, "mode": "torch"}, "mode='torch' has none"),
        ({"backend": "torch"}, "kernel backend of mode='fused'"),
        ({"lr": -1.0}, "invalid learning rate"),
        ({"betas": (0.9, 1.0)}, "betas must lie in"),
    ],
)
def test_bad_configuration(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ApexW(make_params("cpu"), **kwargs)


def test_refuses_float16_and_cpu_capture():
    with pytest.raises(ConfigError, match=r"float16 parameters: cast them to bfloat16"):
        ApexW([torch.zeros(3, dtype=torch.float16, requires_grad=True)])
    with pytest.raises(ConfigError, match="capturable=True captures a CUDA graph"):
        ApexW([torch.zeros(3, requires_grad=True)], capturable=True)
    opt = ApexW(make_params("cpu"))
    with pytest.raises(ConfigError, match="float16"):
        opt.add_param_group({"params": [torch.zeros(2, dtype=torch.float16, requires_grad=True)]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float64, torch.int32])
def test_a_refused_dtype_names_only_accepted_ones(dtype):
    """Core's message offered float16, which ApexW refuses (audit F10)."""
    p = torch.zeros(4, dtype=dtype)
    with pytest.raises(ConfigError) as first:
        ApexW([p], mode_cache=None)
    opt = ApexW(make_params("cpu"), mode_cache=None)
    with pytest.raises(ConfigError) as added:
        opt.add_param_group({"params": (q for q in [p])})
    assert len(opt.param_groups) == 1
    for e, group in ((first, 0), (added, 1)):
        assert str(e.value) == (
            f"parameter #0 of param group {group} (shape (4,)) is {dtype}; ApexW takes float32 "
            "or bfloat16 parameters: cast it or leave it out"
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_a_parameter_cast_after_adding_names_only_accepted_dtypes(dtype):
    q = torch.zeros(4, requires_grad=True)
    opt = ApexW([q], mode="torch")
    q.data = q.data.to(dtype)
    q.grad = torch.ones(4, dtype=dtype)
    with pytest.raises(ConfigError) as e:
        opt.step()
    assert str(e.value).endswith(
        "(was the model cast?); ApexW takes float32 or bfloat16 parameters: cast it back, or "
        "build the optimizer after casting"
    )


def test_the_docstring_says_only_32_bits_of_the_seed_count():
    assert "low 32 bits of ``seed``" in ApexW.__doc__


def test_group_state_must_stay_compact():
    opt = ApexW(make_params("cpu"), mode="torch")
    opt.param_groups[0]["moments"] = "fp32"
    set_grads(opt.param_groups[0]["params"], 1)
    with pytest.raises(ConfigError, match="ApexW keeps moments in"):
        opt.step()


@pytest.mark.parametrize("backend", ["cpu", "triton", "no-such-backend"])
def test_mode_torch_refuses_a_named_kernel_backend(backend):
    """mode='torch' runs core's torch step: a named kernel backend was accepted and dropped."""
    with pytest.raises(ConfigError, match=f"backend='{backend}' names the kernel backend of"):
        ApexW(make_params("cpu"), mode="torch", backend=backend)
    assert ApexW(make_params("cpu"), mode="torch", backend="auto").mode_decision.mode == "torch"


@pytest.mark.parametrize("mode", ["auto", "fused"])
def test_backend_is_checked_at_construction(mode, monkeypatch):
    with pytest.raises(BackendUnavailableError, match="'no-such-backend' is not installed"):
        ApexW(make_params("cpu"), mode=mode, backend="no-such-backend")
    set_cpu_backend(monkeypatch, "failed to import: ImportError: test stand-in")
    with pytest.raises(BackendUnavailableError, match="cannot run here: failed to import"):
        ApexW(make_params("cpu"), mode=mode, backend="cpu")


@pytest.mark.parametrize(
    ("reason", "match"),
    [
        ("failed to import: ImportError: MEMOPT_CPU_ISA='neon'", "MEMOPT_CPU_ISA='neon'"),
        (
            None,
            r"'cpu' is not installed \(from a checkout: pip install packages/memopt-kernels-cpu\)",
        ),
    ],
    ids=["unusable", "not-installed"],
)
def test_fused_mode_says_why_the_kernel_backend_cannot_run(reason, match, monkeypatch):
    set_cpu_backend(monkeypatch, reason)
    params = make_params("cpu")
    opt = ApexW(params, mode="fused")
    set_grads(params, 1)
    before = [p.detach().clone() for p in params]
    with pytest.raises(BackendUnavailableError, match=match):
        opt.step()
    assert all(torch.equal(x, y) for x, y in zip(params, before, strict=True))


def test_amsgrad_in_a_param_group_is_refused():
    p, q = make_params("cpu", shapes=[(8,), (8,)])
    with pytest.raises(ConfigError, match=r"\(param group 0\) sets amsgrad=True"):
        ApexW([{"params": [p], "amsgrad": True}])
    opt = ApexW([{"params": [p], "amsgrad": False}])
    with pytest.raises(ConfigError, match=r"\(param group 1\) sets amsgrad=True"):
        opt.add_param_group({"params": [q], "amsgrad": True})
    assert len(opt.param_groups) == 1


def test_a_state_format_edited_in_a_group_is_refused():
    """``param_groups[0]["state"] = "q8"`` on a bf16-state ApexW: refused at the step, nothing
    changed (it was ignored: the moments stayed bf16)."""
    (p,) = make_params("cpu", shapes=[(8,)])
    opt = ApexW([p], state="bf16", mode="fused")
    set_grads([p], 1)
    opt.param_groups[0]["state"] = "q8"
    before = p.detach().clone()
    with pytest.raises(ConfigError, match=r"sets state='q8', but its moments are 'bf16'"):
        opt.step()
    assert torch.equal(p.detach(), before)
    opt.param_groups[0]["state"] = "bf16"  # naming the format it has is fine
    opt.step()


def test_a_group_giving_state_and_other_moments_is_refused():
    """{"state": "q8", "moments": "bf16"}: one of them won silently (the edit above is refused)."""
    p, q = make_params("cpu", shapes=[(8,), (8,)])
    for bad in ({"state": "q8", "moments": "bf16"}, {"state": "bf16", "moments": "q8"}):
        with pytest.raises(ConfigError, match=r"sets state=.* and moments=.*; give one"):
            ApexW([{"params": [p], **bad}])
    opt = ApexW([p])
    with pytest.raises(ConfigError, match=r"sets state='q8' and moments='bf16'"):
        opt.add_param_group({"params": [q], "state": "q8", "moments": "bf16"})
    opt.add_param_group({"params": [q], "state": "q8", "moments": "q8"})  # agreeing: fine
    assert opt.param_groups[1]["moments"] == "q8"


@pytest.mark.parametrize("mode_cache", [5, "", b"modes.json", ["modes.json"]])
def test_mode_cache_must_be_a_path(mode_cache):
    with pytest.raises(ConfigError, match="mode_cache must be None, 'default' or a non-empty path"):
        ApexW(make_params("cpu"), mode_cache=mode_cache)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("fp32", torch.float32), "state must be one of"),
        (("bf16", torch.bfloat16, "none"), "master must be one of"),
        (("bf16", torch.float16), "param_dtype must be one of"),
        (("q8", torch.int8), "param_dtype must be one of"),
        (("bf16", "float32"), "param_dtype must be one of"),
    ],
)
def test_state_bytes_per_param_refuses_what_apexw_refuses(args, match):
    with pytest.raises(ConfigError, match=match):
        state_bytes_per_param(*args)


@pytest.mark.parametrize(
    ("dtype", "state", "master"),
    [
        (torch.float32, "bf16", "ecc24"),
        (torch.float32, "q8", "ecc24"),
        (torch.bfloat16, "bf16", "ecc24"),
        (torch.bfloat16, "q8", "ecc32"),
    ],
)
def test_state_bytes_at_most_half_of_torch_adamw(dtype, state, master):
    p = torch.zeros(1 << 16, dtype=dtype, requires_grad=True)
    opt = ApexW([p], state=state, master=master, mode="torch")
    opt.init_state()
    per = opt.state_bytes() / p.numel()
    assert per == state_bytes_per_param(state, dtype, master)
    if dtype == torch.float32:
        assert per <= 8 / 2  # torch AdamW: two fp32 moments


def test_grad_scaler_unscales_and_skips_infinite_steps(device):
    if device.type == "cuda" and fused_backend_for(device) is None:
        pytest.skip("no triton")
    a = make_params(device)
    b = twin(a)
    opt, ref = ApexW(a), reference_for(b)
    scaler = torch.amp.GradScaler(device.type, init_scale=1024.0)
    for step in range(1, 8):
        scaler.scale(torch.ones((), device=device))  # what scaler.scale(loss) starts with
        set_grads(a, step, scale=scaler.get_scale())  # as if the loss had been scaled
        set_grads(b, step)
        if step == 4:
            a[1].grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        if step != 4:
            ref.step()
        opt.zero_grad()
        ref.zero_grad()
        assert_same(a, b, opt, ref, f"step {step}")
    assert scaler.get_scale() < 1024.0  # the infinite step lowered it


def test_closure_and_pickle_roundtrip():
    a = make_params("cpu")
    opt = ApexW(a, mode="torch", state="q8", lr=2e-3)

    def closure():
        set_grads(a, 1)
        return torch.tensor(3.0)

    assert float(opt.step(closure)) == 3.0
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert (clone.mode, clone.capturable, clone.mode_decision) == (
            "torch",
            False,
            opt.mode_decision,
        )
        assert clone.param_groups[0]["moments"] == "q8"
        assert clone._cached_steps == {}


def test_zero_grad_default_depends_on_capturable():
    a = make_params("cpu")
    opt = ApexW(a)
    set_grads(a, 1)
    opt.zero_grad()
    assert all(p.grad is None for p in a)


@pytest.mark.parametrize("unscale_first", [False, True], ids=["", "unscale_first"])
@pytest.mark.parametrize("mode", ["fused", "torch"])
def test_grad_scaler_runs_in_the_kernel_without_capturable(
    device, mode, unscale_first, monkeypatch
):
    """Without capturable, GradScaler hands ApexW its scale and found-inf flag: the Triton
    kernel unscales and skips on the device (the flag is never read on the host), the torch
    mode reads the flag once and unscales as the scaler's loop does. Both equal the reference
    stepping the clean steps on unscaled gradients, an inf step changes nothing, and steps
    without the scaler afterwards stay equal (the counts come back from the device). With
    ``scaler.unscale_(opt)`` first (to clip), only the flag is handed over: no second unscale."""
    import memopt_core.optimizer as core_optimizer

    kernel = mode == "fused" and (device.type == "cuda" or triton_interpreter_ready())
    if mode == "fused" and not kernel:
        pytest.skip("no Triton backend here")
    host_reads = []
    real = core_optimizer._unscale_on_host

    def on_host(amp, grads):
        host_reads.append(len(grads))
        return real(amp, grads)

    monkeypatch.setattr(core_optimizer, "_unscale_on_host", on_host)
    a = make_params(device)
    b = twin(a)
    backend = "triton" if kernel else None
    opt = ApexW(a, mode=mode, backend=backend, lr=2e-3)
    ref = reference_for(b, lr=2e-3)
    assert opt._step_supports_amp_scaling
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**14)
    for step in range(1, 7):
        scaler.scale(torch.ones((), device=device))  # what scaler.scale(loss) starts with
        set_grads(a, step, scale=scaler.get_scale())  # a power of two: unscaling is exact
        set_grads(b, step)
        if step == 3:
            a[4].grad.view(-1)[5] = float("inf")
            before = [p.detach().clone() for p in a]
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        if step != 3:
            ref.step()
        else:
            assert all(torch.equal(x, y) for x, y in zip(before, a, strict=True))
        assert_same(a, b, opt, ref, f"{mode} step {step}")
    assert scaler.get_scale() == 2.0**13  # the inf step halved it
    assert int(opt.state[a[1]]["step"]) == 5
    assert (host_reads == []) == kernel, host_reads
    for step in (7, 8):  # no scaler: host steps again
        set_grads(a, step)
        set_grads(b, step)
        opt.step()
        ref.step()
    assert_same(a, b, opt, ref, f"{mode} after the scaler")
    if device.type == "cuda":  # its own graph takes host scalars: the scaler's loop
        assert not ApexW(make_params(device), capturable=True)._step_supports_amp_scaling


def test_grad_scaler_through_auto_mode_trials_and_a_state_dict_round_trip(device):
    """mode="auto"'s trial steps alternate the fused and the torch mode under a GradScaler:
    on CUDA the fused steps count on the device and the torch steps on the host, so each
    switch moves the counts. Every step equals the reference, and a state_dict saved after
    scaled steps loads into a new ApexW that continues with the same bits."""
    if fused_backend_for(device) is None:
        pytest.skip("no fused backend here: auto mode has one candidate")
    a = make_params(device)
    b = twin(a)
    opt = ApexW(a, lr=2e-3, mode_cache=None)
    ref = reference_for(b, lr=2e-3)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)

    def scaled_step(opt, params, step, bad=False):
        scaler.scale(torch.ones((), device=device))
        set_grads(params, step, scale=scaler.get_scale())
        if bad:
            params[3].grad.view(-1)[0] = float("nan")
        scaler.step(opt)
        scaler.update()

    trial = 2 * WARMUP_STEPS + 2 * 2 * TIMED_ROUNDS  # and the decision at the step after it
    for step in range(1, trial + 3):  # one more: step 4 (found inf) updates nothing
        scaled_step(opt, a, step, bad=step == 4)
        if step != 4:
            set_grads(b, step)
            ref.step()
        assert_same(a, b, opt, ref, f"step {step}")
    assert opt.mode_decision is not None  # the trial ended
    saved = opt.state_dict()
    c = twin(a)
    again = ApexW(c, lr=2e-3, mode=opt.mode_decision.mode, mode_cache=None)
    again.load_state_dict(saved)
    for step in (trial + 3, trial + 4):
        for o, params in ((opt, a), (again, c)):
            set_grads(params, step)
            o.step()
        set_grads(b, step)
        ref.step()
    assert_same(a, b, opt, ref, "after the round trip")
    assert_same(c, b, again, ref, "the loaded copy")


@pytest.mark.slow
def test_bf16_second_moment_keeps_decaying_over_3000_steps():
    # a gradient that shrinks 1000x: a round-to-nearest bf16 v with beta2=0.999 would stall near
    # its peak; stochastic rounding tracks fp32 on average
    p = torch.zeros(4096, requires_grad=True)
    q = twin([p])[0]
    opt = ApexW([p], state="bf16", lr=1e-4, weight_decay=0.0)
    ref = MemOptimizer([q], rule="adamw", lr=1e-4, weight_decay=0.0, moments="fp32")
    g = torch.Generator().manual_seed(0)
    for step in range(3000):
        scale = 1.0 if step < 500 else 1e-3
        grad = torch.randn(4096, generator=g) * scale
        p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    v, v_ref = opt.state[p]["exp_avg_sq"].float(), ref.state[q]["exp_avg_sq"]
    ratio = (v.mean() / v_ref.mean()).item()
    assert 0.97 < ratio < 1.03, ratio
    assert (v.mean() < 0.2).item()  # decayed from ~1 (a stalled v stays near its peak)


def test_param_group_state_key():
    a, b = make_params("cpu"), make_params("cpu", seed=1, shapes=[(64,)])
    opt = ApexW(a, state="bf16", mode="torch")
    opt.add_param_group({"params": b, "state": "q8"})
    assert opt.param_groups[1]["moments"] == "q8"
    assert "state" not in opt.param_groups[1]
    set_grads(a + b, 1)
    opt.step()
    assert opt.state[b[0]]["exp_avg"].dtype == torch.float8_e4m3fn
    assert opt.state[a[0]]["exp_avg"].dtype == torch.bfloat16


def test_state_of_a_reordered_parameter_is_refused_and_changes_nothing():
    """fp32 weights (their own master) with q8 moments: an MLP's up (64, 16) and down (16, 64)
    have states of the same sizes, told apart by the state dict's ``param_shape``. The refused
    load changes nothing: the cached step goes on replaying the bits of an optimizer that never
    saw it."""
    up, down = make_params("cpu", shapes=[(64, 16), (16, 64)])
    opt = ApexW([up, down], mode="torch", state="q8", lr=2e-3, mode_cache=None)
    for t in range(2):
        set_grads([up, down], t)
        opt.step()
    sd = opt.state_dict()
    assert [sd["state"][i]["param_shape"].tolist() for i in (0, 1)] == [[64, 16], [16, 64]]

    a = [p.detach().clone().requires_grad_() for p in (down, up)]
    b = [p.detach().clone().requires_grad_() for p in (down, up)]
    victim, bystander = (
        ApexW(ps, mode="torch", state="q8", lr=2e-3, mode_cache=None) for ps in (a, b)
    )
    for t in range(2, 4):
        for o, ps in ((victim, a), (bystander, b)):
            set_grads(ps, t)
            o.step()
    with pytest.raises(
        StateDictError,
        match=r"state of parameter index 0 \(shape \(16, 64\).* saved for a parameter of shape "
        r"\(64, 16\); .*belongs to another parameter",
    ):
        victim.load_state_dict(sd)
    for t in range(4, 6):
        for o, ps in ((victim, a), (bystander, b)):
            set_grads(ps, t)
            o.step()
    assert_same(a, b, victim, bystander, "after the refused load")


def test_a_step_inside_inference_mode_is_refused():
    p = torch.nn.Parameter(torch.randn(40))
    opt = ApexW([p], mode="torch")
    p.grad = torch.randn(40)
    with torch.inference_mode(), pytest.raises(ConfigError, match=r"inside torch.inference_mode"):
        opt.step()
    assert not opt.state


def test_a_refused_step_leaves_no_scaler_flags_behind():
    """As core's step: GradScaler deletes grad_scale / found_inf only after a step that returns,
    and the next scaler.step unscaled by the square of the scale."""
    p = torch.nn.Parameter(torch.ones(64))
    opt = ApexW([p], lr=0.1, mode="torch", mode_cache=None)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(p.sum()).backward()
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="learning rate"):
        scaler.step(opt)
    assert not hasattr(opt, "grad_scale")
    assert not hasattr(opt, "found_inf")
