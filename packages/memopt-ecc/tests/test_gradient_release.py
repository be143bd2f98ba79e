"""Gradient release: bit-identical to the step() loop, no-op step/zero_grad with one warning,
remove(), GradScaler (clean steps bit-identical, non-finite gradients skip), DDP/FSDP1 refused."""

from __future__ import annotations

import copy
import math
import tempfile
import warnings
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


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_release_equals_step_loop_bit_for_bit(name, device):
    ref_model = make_model(device)
    rel_model = copy.deepcopy(ref_model)
    ref_opt = OPTIMIZERS[name](ref_model.parameters())
    rel_opt = OPTIMIZERS[name](rel_model.parameters())
    handle = enable_gradient_release(rel_model, rel_opt)
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


def test_pre_step_can_skip_and_plain_memoptimizer_works():
    model = make_model("cpu")
    opt = MemOptimizer(model.parameters(), rule="adamw", lr=1e-2, master="ecc24", moments="q8")
    seen = []

    def pre_step(p, group):
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


def test_grad_scaler_non_finite_gradient_skips_that_parameter(device):
    model = make_model(device)
    opt = FlashAdamW(model.parameters(), lr=1e-2)
    scaler = scaler_for(device)
    handle = enable_gradient_release(model, opt, grad_scaler=scaler)
    scaler.scale(loss_fn(model, batches(device)[0])).backward()
    scaler.update()
    bad = model.mix.weight
    hook = bad.register_hook(lambda g: g * math.inf)
    before = {id(p): p.detach().clone() for p in model.parameters()}
    code_before = opt.state[bad]["master_code"].clone()
    scaler.scale(loss_fn(model, batches(device)[1])).backward()
    hook.remove()
    assert handle.skipped == 1
    assert torch.equal(bad.detach(), before[id(bad)])
    assert torch.equal(opt.state[bad]["master_code"], code_before)
    assert int(opt.state[bad]["step"]) == 1  # its state did not advance
    for p in model.parameters():
        if p is not bad and p.requires_grad:
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
    """The torch-ops path (bf16 on CUDA) computes what the foreach kernel computes on the CPU."""
    from memopt_ecc import gradient_release as gr

    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(4096, generator=gen) * torch.exp(torch.randn(4096, generator=gen) * 8)
    grad = grad.bfloat16()
    grad[7] = math.inf
    inv = torch.tensor(3.0).double().reciprocal().float()  # not a power of two: rounding shows
    a, b = grad.clone(), grad.clone()
    fa, fb = torch.zeros(()), torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_([a], fa, inv)
    gr._NO_FOREACH_UNSCALE.add(("cpu", torch.bfloat16))
    try:
        gr._unscale_(b, inv, fb)
    finally:
        gr._NO_FOREACH_UNSCALE.discard(("cpu", torch.bfloat16))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
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
