"""Gradient release: bit-identical to the step() loop for every bucket size, one fused update
per bucket, no-op step/zero_grad with one warning, remove(), a backward that raises leaves its
held gradients unapplied, reentrant backward, GradScaler (clean steps bit-identical, a
non-finite gradient skips its bucket), DDP/FSDP1 refused."""

from __future__ import annotations

import copy
import gc
import math
import tempfile
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from ecc_testutil import assert_same_state
from torch import nn

from memopt_core import ConfigError, MemOptimizer
from memopt_ecc import (
    FlashAdamW,
    FlashLion,
    FlashSGD,
    GradientReleaseHandle,
    cast_model,
    enable_gradient_release,
)


class TinyLM(nn.Module):
    """Embedding tied to the output layer, a LayerNorm, a frozen parameter."""

    def __init__(self, vocab: int = 17, d: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.frozen = nn.Parameter(torch.ones(d), requires_grad=False)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, idx):
        x = self.embed(idx)
        x = self.norm(torch.nn.functional.gelu(self.mix(x)) + x) * self.frozen
        return self.out(x)


def make_model(device, seed=0):
    torch.manual_seed(seed)
    return cast_model(TinyLM().to(device))


def batches(device, n=4, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 17, (2, 6), generator=gen).to(device) for _ in range(n)]


def loss_fn(model, idx):
    logits = model(idx[:, :-1]).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 17), idx[:, 1:].reshape(-1))


OPTIMIZERS = {
    "adamw-default": lambda ps: FlashAdamW(ps, lr=1e-2),
    "adamw-ecc32-fp32moments": lambda ps: FlashAdamW(
        ps, lr=1e-2, master_weight_bits=32, quantize=False
    ),
    "lion": lambda ps: FlashLion(ps, lr=1e-3, weight_decay=0.1),
    "sgd-momentum": lambda ps: FlashSGD(ps, lr=1e-1, momentum=0.9),
}


def params_of(model):
    return list(model.parameters())


#: bucket sizes: each parameter alone, a few parameters per bucket (tiny buckets: 64 bytes),
#: the default (the whole model in one bucket)
BUCKETS = {"per-parameter": 0, "tiny": 64 / 2**20, "default": None}


def release(model, opt, bucket, **kw):
    mb = BUCKETS[bucket]
    return enable_gradient_release(model, opt, **kw, **({} if mb is None else {"bucket_mb": mb}))


@pytest.mark.parametrize("bucket", list(BUCKETS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_release_equals_step_loop_bit_for_bit(name, bucket, device):
    ref_model = make_model(device)
    rel_model = copy.deepcopy(ref_model)
    ref_opt = OPTIMIZERS[name](ref_model.parameters())
    rel_opt = OPTIMIZERS[name](rel_model.parameters())
    handle = release(rel_model, rel_opt, bucket)
    assert isinstance(handle, GradientReleaseHandle)
    assert handle.active
    for idx in batches(device):
        ref_opt.zero_grad()
        loss_fn(ref_model, idx).backward()
        ref_opt.step()
        loss_fn(rel_model, idx).backward()
        assert all(p.grad is None for p in rel_model.parameters())  # freed during backward
    assert_same_state(ref_opt, params_of(ref_model), rel_opt, params_of(rel_model))
    handle.remove()


def count_updates(opt):
    """Wrap ``opt.step_parameters``; the list of parameter counts of its calls."""
    calls = []
    inner = opt.step_parameters

    def counted(params, **kw):
        params = list(params)
        calls.append(len(params))
        inner(params, **kw)

    opt.step_parameters = counted
    return calls


@pytest.mark.parametrize(("bucket", "expected"), [("per-parameter", [1] * 5), ("default", [5])])
def test_one_fused_update_per_bucket(bucket, expected):
    """5 trainable tensors (embed/out tied): each alone, or all in the one default bucket,
    updated when backward ends; p.grad is None as soon as each hook ran."""
    model = make_model("cpu")
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    calls = count_updates(opt)
    release(model, opt, bucket)
    seen_grads = []
    for p in model.parameters():
        if p.requires_grad:
            # runs after release's hook (registered earlier): the gradient is gone already
            p.register_post_accumulate_grad_hook(lambda q: seen_grads.append(q.grad))
    loss_fn(model, batches("cpu")[0]).backward()
    assert calls == expected
    assert seen_grads == [None] * 5
    assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters() if p.requires_grad)


def test_tiny_buckets_update_during_backward():
    """A bucket of at most 64 bytes is updated by the hook that fills it, before backward
    ends: the first hooks' parameters are updated while later gradients are still pending."""
    model = make_model("cpu")
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    calls = count_updates(opt)
    steps_seen = []
    model.embed.weight.register_post_accumulate_grad_hook(lambda q: steps_seen.append(len(calls)))
    release(model, opt, "tiny")
    loss_fn(model, batches("cpu")[0]).backward()
    assert len(calls) >= 2
    assert sum(calls) == 5
    assert steps_seen
    assert steps_seen[0] >= 1  # updates had run before the last hook


def test_backward_that_raises_leaves_its_bucket_unapplied():
    """A backward that raises after some hooks held gradients: they are neither applied then
    nor later (a warning at the next backward says so), and the next iterations equal a model
    that never saw the failed batch."""
    ref_model = make_model("cpu")
    rel_model = copy.deepcopy(ref_model)
    ref_opt = FlashAdamW(ref_model.parameters(), lr=1e-2)
    rel_opt = FlashAdamW(rel_model.parameters(), lr=1e-2)
    handle = enable_gradient_release(rel_model, rel_opt)
    before = {n: p.detach().clone() for n, p in rel_model.named_parameters()}

    def boom(g):
        raise RuntimeError("boom")

    # the LayerNorm's weight and bias and mix.bias are held when mix.weight's gradient raises
    hook = rel_model.mix.weight.register_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        loss_fn(rel_model, batches("cpu")[0]).backward()
    hook.remove()
    for n, p in rel_model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    assert handle._release.buckets.by_device  # the held gradients are still there...
    data = batches("cpu", n=3)
    with pytest.warns(RuntimeWarning, match=r"raised before its end.*3 parameter\(s\).*dropped"):
        loss_fn(rel_model, data[1]).backward()  # ...and dropped here
    for idx in data[1:]:
        ref_opt.zero_grad()
        loss_fn(ref_model, idx).backward()
        ref_opt.step()
    loss_fn(rel_model, data[2]).backward()
    assert_same_state(ref_opt, params_of(ref_model), rel_opt, params_of(rel_model))
    handle.remove()


def test_remove_drops_held_gradients():
    model = make_model("cpu")
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    handle = enable_gradient_release(model, opt)
    hook = model.mix.weight.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError):
        loss_fn(model, batches("cpu")[0]).backward()
    hook.remove()
    assert handle._release.buckets.by_device
    handle.remove()
    assert not handle._release.buckets.by_device
    assert not handle._release.buckets.tasks


def test_reentrant_checkpoint_backward_keeps_the_outer_bucket():
    """A reentrant checkpoint runs a nested backward inside the outer one: the gradients the
    outer backward held before are not taken for a failed backward's, and the result equals
    the step loop."""
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make_model("cpu")

        def forward(self, idx):
            x = self.inner.embed(idx)
            mix = lambda x: torch.nn.functional.gelu(self.inner.mix(x)) + x  # noqa: E731
            x = checkpoint(mix, x, use_reentrant=True)
            return self.inner.out(self.inner.norm(x))

    def loss(model, idx):
        logits = model(idx[:, :-1]).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 17), idx[:, 1:].reshape(-1))

    ref_model = Ckpt()
    rel_model = copy.deepcopy(ref_model)
    ref_opt = FlashAdamW(ref_model.parameters(), lr=1e-2)
    rel_opt = FlashAdamW(rel_model.parameters(), lr=1e-2)
    handle = enable_gradient_release(rel_model, rel_opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "dropped" warning
        for idx in batches("cpu"):
            ref_opt.zero_grad()
            loss(ref_model, idx).backward()
            ref_opt.step()
            loss(rel_model, idx).backward()
    assert_same_state(ref_opt, params_of(ref_model), rel_opt, params_of(rel_model))
    handle.remove()


@pytest.mark.parametrize("outside_first", [True, False])
def test_a_parameter_in_and_outside_a_reentrant_checkpoint_is_refused(outside_first):
    """A reentrant checkpoint's region runs its own backward, nested in the outer one: a
    parameter used inside it and outside got its gradient in both, and each updated it with its
    part (5 backwards gave 10 steps). Refused now, naming the parameter, in either order."""
    from torch.utils.checkpoint import checkpoint

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.other = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            inside = lambda h: torch.tanh(self.shared(torch.tanh(self.other(h))))  # noqa: E731
            if outside_first:  # the outer backward reaches `shared` after the nested one
                return checkpoint(inside, self.shared(x), use_reentrant=True)
            return self.shared(checkpoint(inside, x, use_reentrant=True))

    model = cast_model(Shared(), torch.bfloat16)
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    handle = enable_gradient_release(model, opt)
    # a checkpoint needs an input that requires grad; outside_first gets one from `shared`, and
    # an x that required grad would make autograd refuse the update of `shared` it needs first
    x = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=not outside_first)
    with pytest.raises(ConfigError, match=r"two backward passes, one nested in the other"):
        model(x).float().square().mean().backward()
    handle.remove()


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, "32", True])
def test_bucket_mb_must_be_a_finite_size(bad):
    model = make_model("cpu")
    opt = FlashAdamW(model.parameters())
    with pytest.raises(ConfigError, match="bucket_mb"):
        enable_gradient_release(model, opt, bucket_mb=bad)
    assert not opt.gradient_release_active


def test_step_and_zero_grad_warn_once_and_do_nothing():
    model = make_model("cpu")
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    handle = enable_gradient_release(model, opt)
    p = model.mix.weight
    p.grad = torch.ones_like(p)  # a gradient set by hand: step() must not use it
    before = p.detach().clone()
    with pytest.warns(UserWarning, match=r"step\(\) does nothing while enable_gradient_release"):
        assert opt.step() is None
    with pytest.warns(UserWarning, match=r"zero_grad\(\) does nothing"):
        opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per activation: silent now
        opt.step()
        opt.zero_grad()
    assert torch.equal(p.detach(), before)
    assert p.grad is not None
    # enable_gradient_release created the state up front; nothing stepped it
    assert opt.state_bytes() > 0
    assert all(float(st["step"]) == 0 for st in opt.state.values())
    handle.remove()
    assert not handle.active
    handle.remove()  # idempotent
    # normal behaviour again: gradients stay after backward, step() and zero_grad() work
    opt.zero_grad()
    loss_fn(model, batches("cpu")[0]).backward()
    assert model.mix.weight.grad is not None
    opt.step()
    assert not torch.equal(p.detach(), before)
    # the gradients left by that backward would be added to the next one's: refused
    with pytest.raises(ConfigError, match=r"parameter '.*' .* still holds a gradient"):
        enable_gradient_release(model, opt)
    assert not opt.gradient_release_active
    opt.zero_grad()
    # a new activation warns again
    with (
        enable_gradient_release(model, opt) as again,
        pytest.warns(UserWarning, match="does nothing"),
    ):
        opt.step()
    assert not again.active


def test_warnings_name_the_callers_line_and_the_switch_lives_in_core():
    model = make_model("cpu")
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    assert not opt.gradient_release_active
    handle = enable_gradient_release(model, opt)
    assert opt.gradient_release_active
    with pytest.warns(UserWarning, match=r"FlashAdamW\.step\(\) does nothing") as rec:
        opt.step()
    assert rec[0].filename == __file__  # this line, not torch's hook wrapper
    assert "handle.remove()" in str(rec[0].message)
    with pytest.warns(UserWarning, match=r"zero_grad\(\) does nothing") as rec:
        opt.zero_grad()
    assert rec[0].filename == __file__
    # a copy does not inherit the hooks, so it is not in release mode
    twin = copy.deepcopy(opt)
    assert not twin.gradient_release_active
    handle.remove()
    assert not opt.gradient_release_active
    # the optimizer's switch refuses a second owner while a handle holds it
    handle = enable_gradient_release(model, opt)
    with pytest.raises(ConfigError, match="already active"):
        opt.begin_gradient_release(object())
    handle.remove()


def test_plain_memoptimizer_gets_the_same_no_op_step_and_zero_grad():
    model = make_model("cpu")
    opt = MemOptimizer(model.parameters(), rule="adamw", lr=1e-2, master="ecc24", moments="q8")
    with enable_gradient_release(model, opt):
        loss_fn(model, batches("cpu")[0]).backward()
        p = model.mix.weight
        p.grad = torch.ones_like(p)
        before = p.detach().clone()
        code = opt.state[p]["master_code"].clone()
        with pytest.warns(UserWarning, match=r"MemOptimizer\.step\(\) does nothing"):
            assert opt.step() is None
        with pytest.warns(UserWarning, match=r"MemOptimizer\.zero_grad\(\) does nothing"):
            opt.zero_grad()
        assert torch.equal(p.detach(), before)
        assert torch.equal(opt.state[p]["master_code"], code)
        assert int(opt.state[p]["step"]) == 1
        assert p.grad is not None
    opt.step()  # released: the gradient set by hand is used now
    assert int(opt.state[p]["step"]) == 2


def test_activation_errors():
    model = make_model("cpu")
    opt = FlashAdamW(model.parameters())
    handle = enable_gradient_release(model, opt)
    with pytest.raises(ConfigError, match="already active"):
        enable_gradient_release(model, opt)
    handle.remove()
    extra = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    opt2 = FlashAdamW([*model.parameters(), extra])
    with pytest.raises(ConfigError, match="not in the model"):
        enable_gradient_release(model, opt2)
    with pytest.raises(TypeError, match="memopt optimizer"):
        enable_gradient_release(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="GradScaler"):
        enable_gradient_release(model, opt, grad_scaler=object())


def test_parameters_added_or_unfrozen_while_released_are_reported():
    # added: refused (no hook would update them); remove, add, enable again works
    model = make_model("cpu")
    opt = FlashAdamW([model.embed.weight, model.mix.weight], lr=1e-2)
    handle = enable_gradient_release(model, opt)
    rest = [model.mix.bias, model.norm.weight, model.norm.bias]
    with pytest.raises(ConfigError, match=r"add_param_group while gradient release is active"):
        opt.add_param_group({"params": rest})
    assert len(opt.param_groups) == 1
    handle.remove()
    opt.add_param_group({"params": rest})
    handle = enable_gradient_release(model, opt)
    before = model.norm.bias.detach().clone()
    loss_fn(model, batches("cpu")[0]).backward()
    assert not torch.equal(model.norm.bias.detach(), before)
    handle.remove()
    # frozen when release began, trained later: the backward's end raises, after the others'
    # updates; its gradient is kept (nothing applies it)
    model = make_model("cpu")
    model.mix.weight.requires_grad_(False)
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    handle = enable_gradient_release(model, opt)
    model.mix.weight.requires_grad_(True)
    frozen, other = model.mix.weight.detach().clone(), model.mix.bias.detach().clone()
    with pytest.raises(
        ConfigError,
        match=r"#2 of param group 0 \(shape \(12, 12\).*had requires_grad=False when "
        r"enable_gradient_release\(\) ran.*handle.remove\(\)",
    ):
        loss_fn(model, batches("cpu")[0]).backward()
    assert torch.equal(model.mix.weight.detach(), frozen)
    assert model.mix.weight.grad is not None
    assert not torch.equal(model.mix.bias.detach(), other)
    handle.remove()
    model.mix.weight.grad = None
    handle = enable_gradient_release(model, opt)
    loss_fn(model, batches("cpu")[1]).backward()
    assert not torch.equal(model.mix.weight.detach(), frozen)
    handle.remove()


def test_pre_step_can_skip_and_plain_memoptimizer_works():
    model = make_model("cpu")
    opt = MemOptimizer(model.parameters(), rule="adamw", lr=1e-2, master="ecc24", moments="q8")
    seen = []

    def pre_step(p, group):
        # the gradient is in .grad, as the docs promise (it was None: adversarial testing,
        # 2026-12-04); a FlashOptim-style hook reads it there
        assert p.grad is not None
        assert p.grad.shape == p.shape
        assert p.grad.abs().sum() > 0
        seen.append(group is opt.param_groups[0])
        return p is not model.mix.bias  # skip one parameter

    before = model.mix.bias.detach().clone()
    handle = enable_gradient_release(model, opt, pre_step=pre_step)
    loss_fn(model, batches("cpu")[0]).backward()
    assert all(seen)
    # embed/out (tied: one hook), mix.weight, mix.bias, norm.weight, norm.bias
    assert len(seen) == 5
    assert torch.equal(model.mix.bias.detach(), before)
    assert model.mix.bias not in opt.state or int(opt.state[model.mix.bias]["step"]) == 0
    assert int(opt.state[model.mix.weight]["step"]) == 1
    assert model.mix.bias.grad is None  # freed even when skipped
    handle.remove()


# ------------------------------------------------------------------------------ GradScaler
def scaler_for(device):
    return torch.amp.GradScaler(device.type, init_scale=2.0**12, growth_interval=2)


def test_grad_scaler_clean_steps_equal_the_scaler_loop(device):
    ref_model = make_model(device)
    if device.type == "cuda":
        # torch's GradScaler cannot unscale bf16 gradients on CUDA (no kernel): compare in fp32
        cast_model(ref_model, dtype=torch.float32)
    rel_model = copy.deepcopy(ref_model)
    ref_opt, rel_opt = FlashAdamW(ref_model.parameters()), FlashAdamW(rel_model.parameters())
    ref_scaler, rel_scaler = scaler_for(device), scaler_for(device)
    handle = enable_gradient_release(rel_model, rel_opt, grad_scaler=rel_scaler)
    for idx in batches(device, n=5):
        ref_opt.zero_grad()
        ref_scaler.scale(loss_fn(ref_model, idx)).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        rel_scaler.scale(loss_fn(rel_model, idx)).backward()
        rel_scaler.update()
    assert_same_state(ref_opt, params_of(ref_model), rel_opt, params_of(rel_model))
    assert ref_scaler.get_scale() == rel_scaler.get_scale() == 2.0**14  # grew twice
    assert handle.skipped == 0
    handle.remove()


@pytest.mark.parametrize("bucket", ["per-parameter", "default"])
def test_grad_scaler_non_finite_gradient_skips_its_bucket(bucket, device):
    """Per parameter: only the parameter with the inf is skipped. Default bucket (the whole
    model): every parameter of the bucket is skipped, as the ordinary loop skips the step."""
    model = make_model(device)
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    scaler = scaler_for(device)
    handle = release(model, opt, bucket, grad_scaler=scaler)
    scaler.scale(loss_fn(model, batches(device)[0])).backward()
    scaler.update()
    bad = model.mix.weight
    hook = bad.register_hook(lambda g: g * math.inf)
    before = {id(p): p.detach().clone() for p in model.parameters()}
    code_before = opt.state[bad]["master_code"].clone()
    scaler.scale(loss_fn(model, batches(device)[1])).backward()
    hook.remove()
    trainable = [p for p in model.parameters() if p.requires_grad]
    skipped = [bad] if bucket == "per-parameter" else trainable
    assert handle.skipped == len(skipped)
    assert torch.equal(opt.state[bad]["master_code"], code_before)
    for p in trainable:
        if any(p is q for q in skipped):
            assert torch.equal(p.detach(), before[id(p)])
            assert int(opt.state[p]["step"]) == 1  # its state did not advance
        else:
            assert int(opt.state[p]["step"]) == 2
            assert not torch.equal(p.detach(), before[id(p)])
    scaler.update()  # the recorded inf backs the scale off
    assert scaler.get_scale() == 2.0**11
    # scaler.step() is harmless: it calls the no-op step()
    scaler.scale(loss_fn(model, batches(device)[2])).backward()
    with pytest.warns(UserWarning, match="does nothing"):
        scaler.step(opt)
    scaler.update()
    handle.remove()


def test_unscale_fallback_equals_torch_kernel():
    """The torch-ops path (bf16 on CUDA) computes what the foreach kernel computes on the CPU,
    in a bucket mixing a dtype the kernel takes (fp32) with one it is made to refuse (bf16)."""
    from memopt_ecc import gradient_release as gr

    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(4096, generator=gen) * torch.exp(torch.randn(4096, generator=gen) * 8)
    grad = grad.bfloat16()
    grad[7] = math.inf
    g32 = torch.randn(33, generator=gen) * 1e3
    inv = torch.tensor(3.0).double().reciprocal().float()  # not a power of two: rounding shows
    a, b = grad.clone(), grad.clone()
    a32, b32 = g32.clone(), g32.clone()
    fa, fb = torch.zeros(()), torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_([a], fa, inv)
    torch._amp_foreach_non_finite_check_and_unscale_([a32], fa, inv)
    gr._NO_FOREACH_UNSCALE.add(("cpu", torch.bfloat16))
    try:
        gr._unscale_([b32, b], inv, fb)
    finally:
        gr._NO_FOREACH_UNSCALE.discard(("cpu", torch.bfloat16))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert torch.equal(a32, b32)
    assert not torch.equal(b32, g32)
    assert fa.item() == fb.item() == 1.0


# ------------------------------------------------------------------------ DDP and FSDP1
@pytest.fixture(scope="module")
def process_group():
    """A one-process gloo group (FileStore in a temporary folder)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(str(Path(tmp) / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_ddp_is_refused(process_group):
    from torch.nn.parallel import DistributedDataParallel

    model = nn.Linear(4, 4)
    ddp = DistributedDataParallel(model)
    opt = FlashAdamW(ddp.parameters())
    with pytest.raises(TypeError, match=r"DistributedDataParallel.*un-averaged gradient"):
        enable_gradient_release(ddp, opt)
    outer = nn.Sequential(ddp)  # also when DDP sits inside another module
    with pytest.raises(TypeError, match=r"submodule '0'"):
        enable_gradient_release(outer, opt)


def test_fsdp1_is_refused(process_group):
    from torch.distributed.fsdp import FullyShardedDataParallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # world size 1: FSDP1 warns it falls back to NO_SHARD
        fsdp = FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device("cpu"))
    opt = FlashAdamW(fsdp.parameters())
    with pytest.raises(TypeError, match=r"FSDP1.*DDP with the ordinary"):
        enable_gradient_release(fsdp, opt)


def test_lr_schedulers_see_the_release_steps():
    """torch's schedulers warn that lr_scheduler.step() came before optimizer.step() unless the
    wrapped step() ran; with release, step_parameters() is the step (the schedule was right,
    the warning was not)."""
    model = make_model("cpu")
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    handle = enable_gradient_release(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for idx in batches("cpu")[:2]:
            loss_fn(model, idx).backward()
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2.5e-3)
    handle.remove()


# ------------------------------------------------------- training-loop patterns (audit round 4)
def test_a_pre_step_that_raises_leaves_no_gradient_to_apply_late():
    """The hook called pre_step before it took the gradient out of .grad: when pre_step raised,
    the gradient stayed there, and the retried backward added its own and applied both. Now
    the failed backward's gradients are all dropped: the same as never running that batch."""
    data = batches("cpu")
    ref_model = make_model("cpu")
    rel_model = copy.deepcopy(ref_model)
    ref_opt = FlashAdamW(ref_model.parameters(), lr=1e-2)
    rel_opt = FlashAdamW(rel_model.parameters(), lr=1e-2)
    for idx in data[1:]:
        ref_opt.zero_grad()
        loss_fn(ref_model, idx).backward()
        ref_opt.step()
    fail = [True]
    target = rel_model.mix.weight

    def pre_step(p, group):
        if fail[0] and p is target:
            raise RuntimeError("pre_step failed")
        return True

    handle = enable_gradient_release(rel_model, rel_opt, pre_step=pre_step)
    with pytest.raises(RuntimeError, match="pre_step failed"):
        loss_fn(rel_model, data[0]).backward()
    fail[0] = False
    assert target.grad is None
    with pytest.warns(RuntimeWarning, match="were dropped, not applied"):
        loss_fn(rel_model, data[1]).backward()
    for idx in data[2:]:
        loss_fn(rel_model, idx).backward()
    assert_same_state(ref_opt, params_of(ref_model), rel_opt, params_of(rel_model))
    handle.remove()


def test_a_pre_step_that_returns_no_bool_is_refused():
    """A logging callback without `return True` returned None, which skipped every update."""
    model = make_model("cpu")
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    handle = enable_gradient_release(model, opt, pre_step=lambda p, group: None)
    with pytest.raises(TypeError, match=r"pre_step must return True \(update\) or False"):
        loss_fn(model, batches("cpu")[0]).backward()
    handle.remove()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(pre_step=5), TypeError, r"pre_step must be a function .*got int"),
        (dict(allow_unsynchronized="no"), ConfigError, r"allow_unsynchronized must be True or"),
    ],
)
def test_a_pre_step_that_is_no_function_and_a_flag_that_is_no_bool_are_refused(
    kwargs, error, message
):
    """Refused when release is enabled: a pre_step of 5 failed in the first backward's hook,
    with that gradient dropped; "no" read as true and skipped the check of unsynchronized
    models (a helper's hunt, 2026-12-07)."""
    model = make_model("cpu")
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    with pytest.raises(error, match=message):
        enable_gradient_release(model, opt, **kwargs)
    assert not opt.gradient_release_active


def test_a_load_under_release_creates_every_trainable_state_up_front():
    """Release creates the state up front (not in the first backward). A checkpoint of a run in
    which a parameter had no gradient yet holds no state for it (memopt creates it at the first
    gradient, as torch): loaded while release is active, its state is still created by the load
    (a review of 2026-12-06: the first backward's hook created it)."""
    model = make_model("cpu")
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    for idx in batches("cpu", n=2):
        opt.zero_grad()
        loss_fn(model, idx).backward()
        model.mix.bias.grad = None
        opt.step()
    sd = opt.state_dict()
    assert model.mix.bias not in opt.state
    twin = copy.deepcopy(model)
    topt = FlashAdamW(twin.parameters(), lr=1e-2)
    handle = enable_gradient_release(twin, topt)
    topt.load_state_dict(sd)
    trainable = [p for p in twin.parameters() if p.requires_grad]
    assert all(p in topt.state for p in trainable)
    assert int(topt.state[twin.mix.bias]["step"]) == 0
    nbytes = topt.state_bytes()
    loss_fn(twin, batches("cpu", n=3)[2]).backward()
    assert topt.state_bytes() == nbytes
    assert int(topt.state[twin.mix.bias]["step"]) == 1
    assert int(topt.state[twin.mix.weight]["step"]) == 3
    handle.remove()


def _clamp(p, group):
    p.grad = p.grad.clamp(-1e-3, 1e-3)
    return True


def _none_for_mix_bias(p, group):
    if p is group["params"][3]:  # mix.bias (params: embed/out, mix.weight, mix.bias, ...)
        p.grad = None  # a skip, as it is before step() in the ordinary loop
    return True


def _float32(p, group):
    # torch refuses a float32 .grad on a bf16 parameter unless its grad_dtype allows any
    p.grad_dtype = None
    p.grad = p.grad.float() * 0.5
    return True


@pytest.mark.parametrize("bucket", list(BUCKETS))
@pytest.mark.parametrize("pre_step", [_clamp, _none_for_mix_bias, _float32])
def test_a_pre_step_that_assigns_the_gradient_equals_the_step_loop(pre_step, bucket):
    """The hook bucketed the gradient it had before pre_step: an assigned .grad (a per-parameter
    clip written p.grad = p.grad.clamp(...), or None meant as a skip) was ignored, and released
    SGD moved a weight by -100 where the ordinary loop moved it by -1 (audit 2026-12-06). The
    update now takes what .grad holds after pre_step, as step() after the same pre_step does."""
    ref_model = make_model("cpu")
    rel_model = copy.deepcopy(ref_model)
    ref_opt = FlashAdamW(ref_model.parameters(), lr=1e-2)
    rel_opt = FlashAdamW(rel_model.parameters(), lr=1e-2)
    # released updates (step_parameters) create every trainable parameter's state at once, a
    # step only that of parameters with a gradient: the skipped bias has a step-0 state there
    ref_opt.init_state()
    assert rel_opt.param_groups[0]["params"][3] is rel_model.mix.bias
    bias_before = rel_model.mix.bias.detach().clone()
    handle = release(rel_model, rel_opt, bucket, pre_step=pre_step)
    for idx in batches("cpu"):
        ref_opt.zero_grad()
        loss_fn(ref_model, idx).backward()
        for group in ref_opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    assert pre_step(p, group)
        ref_opt.step()
        loss_fn(rel_model, idx).backward()
        assert all(p.grad is None for p in rel_model.parameters())
    assert_same_state(ref_opt, params_of(ref_model), rel_opt, params_of(rel_model))
    if pre_step is _none_for_mix_bias:
        assert torch.equal(rel_model.mix.bias.detach(), bias_before)
        assert int(rel_opt.state[rel_model.mix.bias]["step"]) == 0
        assert int(rel_opt.state[rel_model.mix.weight]["step"]) == 4
    handle.remove()


def test_a_pre_step_that_assigns_a_gradient_the_update_cannot_take_is_refused():
    """An assigned gradient is checked in its parameter's hook (the first one: norm.weight's),
    with the parameter's name."""
    model = make_model("cpu")
    opt = FlashAdamW(model.named_parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]

    def pre_step(p, group):
        p.grad_dtype = None  # else torch's .grad setter refuses the float64 tensor itself
        p.grad = p.grad.double()
        return True

    handle = enable_gradient_release(model, opt, pre_step=pre_step, bucket_mb=0)
    with pytest.raises(
        ConfigError,
        match=r"pre_step set the \.grad of parameter 'norm\.weight' .* to a tensor of shape "
        r"\(12,\), torch\.float64, on cpu; the update takes gradients of the parameter's "
        r"shape and device, in its dtype or float32 .* or None to skip the update",
    ):
        loss_fn(model, batches("cpu")[0]).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    handle.remove()


def test_remove_inside_a_backward_is_refused():
    """remove() from a hook dropped the gradients the running backward held: the parameters
    released before it missed that batch's update."""
    model = make_model("cpu")
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    handles = []
    handles.append(
        enable_gradient_release(model, opt, pre_step=lambda p, g: handles[0].remove() or True)
    )
    with pytest.raises(ConfigError, match=r"remove\(\) inside a running backward"):
        loss_fn(model, batches("cpu")[0]).backward()
    assert handles[0].active
    handles[0].remove()  # between backwards: fine
    assert not handles[0].active


def test_a_parameter_released_by_two_optimizers_is_refused():
    """The first optimizer's hook took the gradient, so the second never updated the
    parameter, silently."""
    model = make_model("cpu")
    first = FlashAdamW(model.parameters(), lr=1e-2)
    second = FlashAdamW(model.parameters(), lr=1e-2)
    handle = enable_gradient_release(model, first)
    with pytest.raises(ConfigError, match="already released by another optimizer's handle"):
        enable_gradient_release(model, second)
    handle.remove()
    enable_gradient_release(model, second).remove()  # once the first is removed


def _hooks_on(model):
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def test_dropping_the_optimizer_and_handle_ends_the_release_without_gc():
    """Optimizer and handle held each other: dropped without remove(), the hooks kept taking
    every gradient and updating the weights until the cyclic collector happened to run."""
    model = make_model("cpu")
    opt = FlashAdamW(model.parameters(), lr=1.0)
    handle = enable_gradient_release(model, opt)
    loss_fn(model, batches("cpu")[0]).backward()
    gc.disable()
    try:
        del opt, handle
        assert _hooks_on(model) == 0  # removed with the release
        before = [p.detach().clone() for p in model.parameters()]
        loss_fn(model, batches("cpu")[1]).backward()
        assert model.mix.weight.grad is not None  # the gradient stays for whoever steps next
        for b, p in zip(before, model.parameters(), strict=True):
            assert torch.equal(b, p.detach())
    finally:
        gc.enable()


def test_a_dropped_release_frees_its_model_without_remove():
    """Each hook held its param group, and so its own parameter: a cycle through autograd's
    hook table that gc cannot see, so every model of a sweep stayed in memory."""
    model = make_model("cpu")
    handle = enable_gradient_release(model, FlashAdamW(model.parameters(), lr=1e-2))
    loss_fn(model, batches("cpu")[0]).backward()
    weight = weakref.ref(model.mix.weight)
    del model, handle
    gc.collect()
    assert weight() is None


@pytest.mark.parametrize("keep", ["optimizer", "handle"])
def test_either_the_optimizer_or_the_handle_keeps_the_release_active(keep):
    """The return value ignored (the optimizer kept) or the optimizer built inline (the handle
    kept): the release goes on in both cases, bit for bit as with both kept."""
    ref_model = make_model("cpu")
    ref_opt = FlashAdamW(ref_model.parameters(), lr=1e-2)
    ref_handle = enable_gradient_release(ref_model, ref_opt)
    model = make_model("cpu")
    if keep == "optimizer":
        opt = FlashAdamW(model.parameters(), lr=1e-2)
        enable_gradient_release(model, opt)
    else:
        handle = enable_gradient_release(model, FlashAdamW(model.parameters(), lr=1e-2))
    gc.collect()
    for idx in batches("cpu"):
        loss_fn(ref_model, idx).backward()
        loss_fn(model, idx).backward()
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(model.mix.weight, make_model("cpu").mix.weight)
    ref_handle.remove()
    if keep == "handle":
        handle.remove()
        assert _hooks_on(model) == 0
    else:
        assert opt.gradient_release_active
        assert _hooks_on(model) > 0
