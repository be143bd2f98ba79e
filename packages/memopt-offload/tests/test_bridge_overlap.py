"""``attach_hooks(model, overlap_forward=True)``: the next forward overlaps the host updates.

Every test slows the host update down (``slow_updates``), so that the forward really runs while
updates are still queued: a forward that read a weight without waiting for it would compute a
different loss, and the losses are compared bit for bit with the reference's at every step.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from offload_testutil import Reference, Tied, assert_same_params, batch, loss_of, make_model

from memopt_core.errors import ConfigError, OffloadError
from memopt_offload import AdamBridge

PRECISIONS = ["fp32", "bf16", "fp8", "bf16-ecc24", "compact"]


@pytest.fixture
def slow_updates(monkeypatch):
    """Each bucket's host update starts 3 ms late (the dispatcher thread sleeps first)."""
    update = AdamBridge._update

    def late(self, bucket, coef):
        time.sleep(0.003)
        update(self, bucket, coef)

    monkeypatch.setattr(AdamBridge, "_update", late)


def sync_device(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_overlapped_forward_matches_reference(device, precision, slow_updates):
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    # one parameter per bucket: the forward waits for each module's own
    opt = AdamBridge(
        model.parameters(), lr=3e-3, weight_decay=0.05, precision=precision, bucket_mb=1e-6
    )
    ref = Reference(ref_model, precision, lr=3e-3, weight_decay=0.05)
    opt.attach_hooks(model, overlap_forward=True)
    in_flight = 0
    for t in range(40):
        x = batch(t, device)
        loss = loss_of(model, x)
        ref_loss = loss_of(ref_model, x)
        assert torch.equal(loss, ref_loss), f"step {t}: the forward read a stale weight"
        loss.backward()
        ref_loss.backward()
        opt.step_sync()
        in_flight += bool(opt._inflight)
        ref.step()
        ref_model.zero_grad()
    # step_sync returned before the updates landed, so the forwards really overlapped them
    assert in_flight >= 39
    opt.synchronize()
    assert not opt._inflight
    sync_device(device)
    assert_same_params(model, ref_model, "after synchronize()")
    opt.detach_hooks()


def test_overlap_equals_the_waiting_pipeline_with_clipping_and_a_scheduler(device, slow_updates):
    # the scheduler changes the lr right after step_sync, while the updates are still queued:
    # each update must use the lr of its own step
    def build():
        model = make_model(device, seed=4)
        opt = AdamBridge(
            model.parameters(), lr=5e-3, precision="bf16", max_grad_norm=0.05, bucket_mb=1e-6
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return model, opt, sched

    (model, opt, sched), (twin, twin_opt, twin_sched) = build(), build()
    opt.attach_hooks(model, overlap_forward=True)
    twin_opt.attach_hooks(twin)
    for t in range(12):
        x = batch(t, device)
        losses = []
        for m, o, s in ((model, opt, sched), (twin, twin_opt, twin_sched)):
            loss = loss_of(m, x)
            loss.backward()
            losses.append(loss)
            o.step_sync()
            s.step()
        assert torch.equal(*losses), f"step {t}"
        assert opt.last_grad_norm == twin_opt.last_grad_norm
    opt.synchronize()
    sync_device(device)
    assert_same_params(model, twin, "after 12 steps")


def test_tied_weights_accumulation_and_state_dict(device, slow_updates):
    torch.manual_seed(5)
    model = Tied().to(device=device, dtype=torch.bfloat16)
    ref_model = copy.deepcopy(model)
    opt = AdamBridge(model.parameters(), lr=1e-2, precision="compact", bucket_mb=1e-6)
    ref = Reference(ref_model, "compact", lr=1e-2)
    opt.attach_hooks(model, overlap_forward=True)

    def loss_on(m, ids):
        return torch.nn.functional.cross_entropy(m(ids).float().flatten(0, 1), ids.flatten())

    for t in range(8):
        micro = [
            torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(10 * t + k))
            for k in range(2)
        ]
        with opt.no_update():  # the first micro-batch's gradients stay on the device
            losses = [loss_on(model, micro[0].to(device))]
            losses[0].backward()
        losses.append(loss_on(model, micro[1].to(device)))
        losses[1].backward()
        for ids, loss in zip(micro, losses, strict=True):
            ref_loss = loss_on(ref_model, ids.to(device))
            assert torch.equal(loss, ref_loss), f"step {t}: the forward read a stale weight"
            ref_loss.backward()
        opt.step_sync()
        ref.step()
        ref_model.zero_grad()
        if t % 4 == 3:  # model.state_dict() waits for the updates by itself
            ours, theirs = model.state_dict(), ref_model.state_dict()
            for (name, w), r in zip(ours.items(), theirs.values(), strict=True):
                assert torch.equal(w, r), f"step {t}: {name}"
    opt.step_sync()  # no new gradients: nothing to do
    from memopt_kernels_cpu import ops

    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        r = ref.masters[id(q)]
        decoded = ops.decode_master("ecc24", r.detach(), ref.opt.state[r]["master_code"])
        assert torch.equal(opt.master_weight(p), decoded)  # master_weight() waits too


class Peek(torch.nn.Module):
    """Reads ``a.weight`` without calling ``a``: no pre-hook of ``a`` ever waits for it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(x @ self.a.weight.T)


def test_a_read_outside_the_owning_module_is_refused(device, slow_updates):
    model = Peek().to(device=device, dtype=torch.bfloat16)
    opt = AdamBridge(model.parameters(), lr=1e-2, bucket_mb=1e-6)
    opt.attach_hooks(model, overlap_forward=True)
    x = torch.randn(4, 8, device=device, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    opt.step_sync()  # nothing was in flight during that first forward
    # the first forward with updates in flight runs under the read check
    with pytest.raises(OffloadError, match=r"read parameter a\.weight|read parameter #"):
        model(x)
    opt.synchronize()  # recovers: every weight landed
    model(x).float().sum().backward()
    opt.step_sync()
    opt.detach_hooks()


class Extra(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Linear(8, 1)  # its module never runs in forward

    def forward(self, x):
        return self.net(x)


def test_a_gradient_of_a_weight_no_forward_waited_for_is_an_error(device, slow_updates):
    model = Extra().to(device=device, dtype=torch.bfloat16)
    opt = AdamBridge(model.parameters(), lr=1e-2, bucket_mb=1e-6)
    opt.attach_hooks(model, overlap_forward=True)
    x = torch.randn(4, 8, device=device, dtype=torch.bfloat16)

    def loss():  # reads scale.weight outside the model's forward
        return model(x).float().sum() + model.scale.weight.float().pow(2).sum()

    loss().backward()
    opt.step_sync()
    model(x)  # the read check of the first overlapped forward passes: scale is not read there
    with pytest.raises(OffloadError, match="no forward pre-hook waited"):
        loss().backward()
    # with synchronize() before the read outside the forward it is allowed
    model.zero_grad()
    opt._pending.clear()
    opt.synchronize()
    opt.step_sync()
    out = model(x).float().sum()
    opt.synchronize()
    (out + model.scale.weight.float().pow(2).sum()).backward()
    opt.step_sync()


def test_a_failed_update_surfaces_in_the_next_forward(device, monkeypatch):
    model = make_model(device)
    opt = AdamBridge(model.parameters(), lr=1e-3)
    opt.attach_hooks(model, overlap_forward=True)

    def fail(*args):
        raise RuntimeError("injected")

    with monkeypatch.context() as m:
        m.setattr(opt, "_update", fail)
        loss_of(model, batch(0, device)).backward()
        opt.step_sync()  # returns: the update fails on the dispatcher thread
    with pytest.raises(OffloadError, match=r"an update failed \(RuntimeError: injected\)"):
        loss_of(model, batch(1, device))
    loss_of(model, batch(2, device)).backward()
    opt.step_sync()
    opt.synchronize()


@pytest.mark.parametrize("how", ["copy_", "data"])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_weight_written_while_its_update_is_in_flight_is_refused(
    device, monkeypatch, overlap, how
):
    """A weight written while its update was in flight (with overlap_forward after step_sync(),
    a clamp or pruning mask applied after each step; without it between backward and
    step_sync()) was overwritten by the update's upload, silently. The update refuses it now
    when the write came before the upload (held here until the write is done)."""
    model = make_model(device)
    opt = AdamBridge(model.parameters(), lr=1e-3, precision="bf16")
    opt.attach_hooks(model, overlap_forward=overlap)
    gate = threading.Event()
    update = AdamBridge._update

    def gated(self, bucket, coef):
        assert gate.wait(30)
        update(self, bucket, coef)

    monkeypatch.setattr(AdamBridge, "_update", gated)
    loss_of(model, batch(0, device)).backward()
    if overlap:
        opt.step_sync()  # returns with the update queued
    w = model[0].weight
    with torch.no_grad():
        if how == "copy_":
            w.zero_()
        else:
            w.data = torch.zeros_like(w)
    gate.set()
    with pytest.raises(
        OffloadError, match=r"#0 of param group 0 \(shape \(48, 33\)\) was written wh"
    ):
        opt.synchronize() if overlap else opt.step_sync()
    assert torch.equal(w, torch.zeros_like(w))  # not overwritten
    loss_of(model, batch(1, device)).backward()  # usable again (after a reload, in practice)
    opt.step_sync()
    opt.synchronize()


def test_detach_waits_and_reattach_without_overlap(device, slow_updates):
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt = AdamBridge(model.parameters(), lr=2e-3, precision="bf16", bucket_mb=1e-6)
    ref = Reference(ref_model, "bf16", lr=2e-3)
    for t, overlap in enumerate([True, True, False, True, False, False]):
        opt.attach_hooks(model, overlap_forward=overlap)
        x = batch(t, device)
        loss_of(model, x).backward()
        loss_of(ref_model, x).backward()
        opt.step_sync()
        opt.detach_hooks()  # waits for the updates in flight
        assert not opt._inflight
        ref.step()
        ref_model.zero_grad()
        sync_device(device)
        assert_same_params(model, ref_model, f"step {t}")


def test_overlap_forward_must_be_a_bool(device):
    model = make_model(device)
    opt = AdamBridge(model.parameters())
    with pytest.raises(ConfigError, match="overlap_forward"):
        opt.attach_hooks(model, overlap_forward="yes")


def test_detach_hooks_removes_a_read_guard_an_interrupted_forward_left(device):
    """A KeyboardInterrupt in the first overlapped forward skips torch's always-called forward
    hook (it catches Exceptions only), which exits the read guard; detach_hooks() exits it, so
    it does not stay on torch's mode stack (every torch call would go through it)."""
    from torch.overrides import _get_current_function_mode_stack

    model = make_model(device)
    opt = AdamBridge(model.parameters(), lr=1e-2, precision="bf16")
    opt.attach_hooks(model, overlap_forward=True)
    x = batch(0, device)
    loss_of(model, x).backward()
    opt.step_sync()

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = model[1].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(x)
    handle.remove()
    assert _get_current_function_mode_stack()  # the guard is still entered here
    opt.detach_hooks()
    assert not _get_current_function_mode_stack()
