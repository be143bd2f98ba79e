"""AdamBridge against the reference, bit for bit: every precision, with and without hooks, 100+
steps; buckets, many tiny tensors, transfer-heavy models, clipping, accumulation, schedulers,
tied and frozen weights, param groups, state-dict resume."""

from __future__ import annotations

import copy

import pytest
import torch
from offload_testutil import (
    BOTH,
    OddSizes,
    Reference,
    Tied,
    assert_same_params,
    batch,
    both_updates,
    loss_of,
    make_model,
    step_pair,
    train_pair,
)

from memopt_core.errors import ConfigError
from memopt_offload import AdamBridge

PRECISIONS = ["fp32", "bf16", "fp8", "bf16-ecc24", "compact"]


@pytest.mark.parametrize("hooks", [True, False], ids=["hooks", "step"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_matches_reference_120_steps(device, precision, hooks):
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt = AdamBridge(model.parameters(), lr=3e-3, weight_decay=0.05, precision=precision)
    ref = Reference(ref_model, precision, lr=3e-3, weight_decay=0.05)
    train_pair(model, ref_model, opt, ref, 120, device, hooks=hooks)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        m = opt.master_weight(p)
        r = ref.masters[id(q)].detach()
        if precision in ("bf16-ecc24", "compact"):
            code = ref.opt.state[ref.masters[id(q)]]["master_code"]
            from memopt_kernels_cpu import ops

            r = ops.decode_master("ecc24", r, code)
        assert torch.equal(m, r)
    # the host state moved: a stalled or skipped update would leave the masters at init
    assert any(
        not torch.equal(opt.master_weight(p), p0.detach().float().cpu())
        for p, p0 in zip(model.parameters(), make_model(device).parameters(), strict=True)
    )


@pytest.mark.parametrize("precision", ["bf16", "bf16-ecc24", "compact"])
def test_float32_parameters(device, precision):
    # float32 parameters keep an fp32 master whatever the precision names for bf16 ones
    model = make_model(device, dtype=torch.float32)
    ref_model = copy.deepcopy(model)
    opt = AdamBridge(model.parameters(), lr=1e-3, precision=precision)
    ref = Reference(ref_model, precision, lr=1e-3)
    train_pair(model, ref_model, opt, ref, 12, device, hooks=True, dtype=torch.float32)


@pytest.mark.parametrize("bucket_mb", [1e-6, 0.004, 64.0])
def test_bucket_sizes_give_the_same_bits(device, bucket_mb):
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt = AdamBridge(model.parameters(), lr=2e-3, precision="fp8", bucket_mb=bucket_mb)
    ref = Reference(ref_model, "fp8", lr=2e-3)
    train_pair(model, ref_model, opt, ref, 10, device, hooks=True)


class ManyTiny(torch.nn.Module):
    def __init__(self, n: int = 300) -> None:
        super().__init__()
        self.ws = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(1 + i % 41) / 4) for i in range(n)
        )

    def forward(self, x):
        return sum((w * x[: w.numel()]).sum() ** 2 for w in self.ws).reshape(1)


@both_updates("bf16")
def test_many_tiny_tensors(device, precision, update):
    torch.manual_seed(3)
    model = ManyTiny().to(device=device, dtype=torch.bfloat16)
    ref_model = copy.deepcopy(model)
    opt = AdamBridge(
        model.parameters(), lr=1e-3, precision=precision, update=update, bucket_mb=0.0005
    )
    ref = Reference(ref_model, precision, lr=1e-3)
    opt.attach_hooks(model)
    step_pair(
        model, ref_model, opt, ref, [batch(t, device, n=1, d=41).reshape(-1) for t in range(6)]
    )


class TransferHeavy(torch.nn.Module):
    """Huge parameters, almost no compute: the copies dominate the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(n) / 8) for n in (1 << 20, 3 * (1 << 18) + 1, 1 << 19)
        )
        self.small = torch.nn.Linear(4, 4)

    def forward(self, x):
        s = sum(w[:4] * x for w in self.big)
        return self.small(s).pow(2).sum() + sum(w.float().square().mean() for w in self.big)


@both_updates("bf16")
def test_transfers_far_larger_than_compute(device, precision, update):
    torch.manual_seed(4)
    model = TransferHeavy().to(device=device, dtype=torch.bfloat16)
    ref_model = copy.deepcopy(model)
    opt = AdamBridge(model.parameters(), lr=1e-3, precision=precision, update=update, bucket_mb=0.5)
    ref = Reference(ref_model, precision, lr=1e-3)
    opt.attach_hooks(model)
    step_pair(
        model, ref_model, opt, ref, [batch(t, device, n=1, d=4).reshape(-1) for t in range(5)]
    )


@both_updates("bf16")
def test_gradient_accumulation(device, precision, update):
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt = AdamBridge(
        model.parameters(), lr=2e-3, precision=precision, update=update, **BOTH[update]
    )
    ref = Reference(ref_model, precision, lr=2e-3)
    opt.attach_hooks(model)
    for t in range(4):
        for micro in range(3):
            x = batch(10 * t + micro, device)
            if micro < 2:
                with opt.no_update():
                    loss_of(model, x).backward()
            else:
                loss_of(model, x).backward()
            loss_of(ref_model, x).backward()
        opt.step_sync()
        ref.step()
        ref_model.zero_grad()
        assert_same_params(model, ref_model, f"step {t}")
        assert all(p.grad is None for p in model.parameters())  # freed once used


@both_updates("bf16")
def test_step_sync_after_no_update_frees_the_gradients(device, precision, update):
    # step_sync() after a backward inside no_update() applies the accumulated gradients; with
    # hooks it frees them as the hooks do, so the next backward's are not added to them
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt = AdamBridge(
        model.parameters(), lr=2e-3, precision=precision, update=update, **BOTH[update]
    )
    ref = Reference(ref_model, precision, lr=2e-3)
    opt.attach_hooks(model)
    with opt.no_update():
        loss_of(model, batch(0, device)).backward()
    opt.step_sync()
    assert all(p.grad is None for p in model.parameters())
    for t in range(2):
        if t:
            loss_of(model, batch(t, device)).backward()
            opt.step_sync()
        loss_of(ref_model, batch(t, device)).backward()
        ref.step()
        ref_model.zero_grad()
        assert_same_params(model, ref_model, f"step {t}")
    opt.detach_hooks()
    loss_of(model, batch(2, device)).backward()
    opt.step()
    assert all(p.grad is not None for p in model.parameters())  # without hooks: torch's step


@both_updates("fp32")
def test_lr_scheduler_and_param_groups(device, precision, update):
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    decay = [model[0].weight, model[3].weight]
    rest = [model[0].bias, model[2].weight, model[2].bias, model[3].bias]
    opt = AdamBridge(
        [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}],
        lr=2e-3,
        weight_decay=0.1,
        precision=precision,
        update=update,
        **BOTH[update],
    )
    rdecay = [ref_model[0].weight, ref_model[3].weight]
    rrest = [ref_model[0].bias, ref_model[2].weight, ref_model[2].bias, ref_model[3].bias]
    ref = Reference(
        ref_model,
        precision,
        groups=[{"params": rdecay}, {"params": rrest, "weight_decay": 0.0, "lr": 5e-3}],
        lr=2e-3,
        weight_decay=0.1,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    opt.attach_hooks(model)
    for t in range(6):  # filterwarnings=error: a scheduler-order warning would fail here
        x = batch(t, device)
        loss_of(model, x).backward()
        loss_of(ref_model, x).backward()
        opt.step_sync()
        for g, rg in zip(opt.param_groups, ref.opt.param_groups, strict=True):
            rg["lr"] = g["lr"]  # the schedule as AdamBridge saw it
        ref.step()
        ref_model.zero_grad()
        sched.step()
        assert_same_params(model, ref_model, f"step {t}")
    assert opt.param_groups[1]["lr"] == pytest.approx(5e-3 / 7)


@both_updates("compact")
def test_tied_and_frozen_weights(device, precision, update):
    torch.manual_seed(5)
    model = Tied().to(device=device, dtype=torch.bfloat16)
    model.mid.bias.requires_grad_(False)
    frozen = model.mid.bias.detach().clone()
    ref_model = copy.deepcopy(model)
    opt = AdamBridge(model.parameters(), lr=1e-2, precision=precision, update=update)
    ref = Reference(ref_model, precision, lr=1e-2)
    # host memory for emb (= head) weight and mid weight only: the frozen bias has none
    assert opt.host_bytes() < 2 * (50 * 16 + 16 * 16) * 8
    if update == "device":  # ECC-24 code + bf16 m, v
        assert opt.state_bytes() == 5 * (50 * 16 + 16 * 16)
    with pytest.raises(ConfigError, match="does not train"):
        opt.master_weight(model.mid.bias)
    opt.attach_hooks(model)
    for t in range(8):
        ids = torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(t)).to(device)
        for m in (model, ref_model):
            torch.nn.functional.cross_entropy(
                m(ids).float().flatten(0, 1), ids.flatten()
            ).backward()
        opt.step_sync()
        assert all(p.grad is None for p in model.parameters())  # freed once used
        ref.step()
        ref_model.zero_grad()
        assert_same_params(model, ref_model, f"step {t}")
    assert model.head.weight is model.emb.weight
    assert torch.equal(model.mid.bias, frozen)


@pytest.mark.parametrize("mode", ["wait", "overlap"])
@both_updates("bf16")
def test_clipping(device, mode, precision, update):
    # on the device, a piece's coefficient must scale its range of the gradient only, once
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    max_norm = 0.05  # below the gradient norms here, so every step clips
    opt = AdamBridge(
        model.parameters(), lr=2e-3, precision=precision, max_grad_norm=max_norm,
        clip_mode=mode, update=update, **BOTH[update],
    )  # fmt: skip
    ref = Reference(ref_model, precision, lr=2e-3)
    opt.attach_hooks(model)
    prev = None
    clipped = 0
    for t in range(6):
        x = batch(t, device)
        loss_of(model, x).backward()
        loss_of(ref_model, x).backward()
        grads = [p.grad for p in ref_model.parameters()]
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
        total = torch.linalg.vector_norm(norms).item()
        reported = opt.step_sync()
        assert reported == total
        # the same norm torch's clip_grad_norm_ computes, to float rounding
        torch_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1e9)  # scales by 1
        assert torch_norm.item() == pytest.approx(total, rel=1e-2)
        coef = min(1.0, max_norm / (total + 1e-6))
        use = coef if (mode == "wait" or prev is None) else prev
        clipped += use < 1
        ref.step(use)
        ref_model.zero_grad()
        prev = coef
        assert_same_params(model, ref_model, f"step {t}")
    assert clipped == 6


def test_clipping_reads_the_norms_after_the_copy_stream(device, monkeypatch):
    """The host path takes each gradient's norm on the copy stream: the total must wait for
    those kernels (a delay queued there first would otherwise let the current stream read the
    norms' memory before it is written)."""
    if device.type != "cuda":
        pytest.skip("one stream on the CPU")
    copy_out = AdamBridge._copy_out

    def late_copy_out(self, bucket):
        with torch.cuda.stream(self._stream_pair()[0]):
            torch.cuda._sleep(100_000_000)  # about 50 ms of the copy stream's time
        copy_out(self, bucket)

    monkeypatch.setattr(AdamBridge, "_copy_out", late_copy_out)
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt = AdamBridge(model.parameters(), lr=2e-3, precision="bf16", max_grad_norm=0.05)
    opt.attach_hooks(model)
    for t in range(3):
        with torch.no_grad():  # the twin computes the same gradients from the same weights
            for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
                q.copy_(p)
        x = batch(t, device)
        loss_of(model, x).backward()
        loss_of(ref_model, x).backward()
        norms = [
            torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in ref_model.parameters()
        ]
        assert opt.step_sync() == torch.linalg.vector_norm(torch.stack(norms)).item(), t
        ref_model.zero_grad()


@pytest.mark.parametrize("beta2", [0.999, 0.5])
def test_state_dict_resume_is_bit_identical(device, tmp_path, beta2):
    """q8 second moments are stored divided by their decay (beta2 0.5: by 0.5**(k % 8)); the
    saved dict records the normalizing beta2, so the resumed run reads them as they were."""

    def build(seed=0):
        model = make_model(device, seed=seed)
        opt = AdamBridge(
            model.parameters(), lr=2e-3, betas=(0.9, beta2), precision="compact", seed=7
        )
        return model, opt

    straight, sopt = build()
    sopt.attach_hooks(straight)
    for t in range(10):
        loss_of(straight, batch(t, device)).backward()
        sopt.step_sync()

    first, fopt = build()
    fopt.attach_hooks(first)
    for t in range(6):
        loss_of(first, batch(t, device)).backward()
        fopt.step_sync()
    torch.save({"model": first.state_dict(), "opt": fopt.state_dict()}, tmp_path / "ck.pt")

    resumed, ropt = build(seed=99)  # different init: everything must come from the checkpoint
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    resumed.load_state_dict(ck["model"])
    ropt.load_state_dict(ck["opt"])
    ropt.attach_hooks(resumed)
    for t in range(6, 10):
        loss_of(resumed, batch(t, device)).backward()
        ropt.step_sync()
    assert_same_params(straight, resumed, "resumed")


def test_torchs_state_dict_helpers_resume_bit_identically_into_another_seed(device):
    """torch's get_state_dict / set_state_dict keep only an optimizer's 'state' and
    'param_groups': the memopt entry (precision, seed, version, clipping state) travels in
    every saved group. Before, AdamBridge refused such a dict ("not saved by AdamBridge").
    They also take an optimizer whose ``optimizer.state`` is false for one never stepped and,
    with no gradient present, step it once with zero gradients at lr 0: AdamBridge's state is
    true (it exists from construction), so neither the run saved from nor the one loaded into
    takes that step (it advanced the step counts and decayed the moments)."""
    pytest.importorskip("torch.distributed")
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build(seed, init=0):
        model = make_model(device, seed=init)
        ps = list(model.parameters())
        groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": 1e-3}]
        opt = AdamBridge(
            groups,
            lr=2e-3,
            precision="compact",  # ECC-24 masters and q8 moments: stochastic rounding
            seed=seed,
            max_grad_norm=0.5,
            clip_mode="overlap",  # the next step clips with the saved coefficient
        )
        return model, opt

    def train(model, opt, steps, start=0):
        for t in range(start, start + steps):
            loss_of(model, batch(t, device)).backward()
            opt.step_sync()
            opt.zero_grad()

    straight, sopt = build(7)
    train(straight, sopt, 8)
    first, fopt = build(7)
    train(first, fopt, 5)
    assert all(p.grad is None for p in first.parameters())  # as a checkpoint is usually taken
    msd, osd = copy.deepcopy(get_state_dict(first, fopt))
    resumed, ropt = build(99, init=1)
    set_state_dict(resumed, ropt, model_state_dict=msd, optim_state_dict=osd)
    # the load keeps the empty state that reads as true
    assert bool(ropt.state)
    assert len(ropt.state) == 0
    train(resumed, ropt, 3, start=5)
    assert_same_params(straight, resumed, "resumed through torch's helpers")
    train(first, fopt, 3, start=5)  # the run get_state_dict read continues undisturbed
    assert_same_params(straight, first, "continued after get_state_dict")
    assert all("memopt" not in g for g in ropt.param_groups)
    assert "memopt" not in osd
    metas = [g["memopt"] for g in osd["param_groups"]]
    assert metas[0] == metas[1]
    assert metas[0]["seed"] == 7
    assert metas[0]["clip_coef"] is not None


@pytest.mark.parametrize("hooks", [True, False], ids=["hooks", "step"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_odd_sizes(device, precision, hooks):
    torch.manual_seed(0)
    model = OddSizes().to(device=device, dtype=torch.bfloat16)
    ref_model = copy.deepcopy(model)
    opt = AdamBridge(model.parameters(), lr=1e-2, precision=precision)
    ref = Reference(ref_model, precision, lr=1e-2)
    if hooks:
        opt.attach_hooks(model)
    xs = [batch(t, device, n=1, d=33).reshape(-1) for t in range(5)]
    step_pair(model, ref_model, opt, ref, xs, hooks=hooks)
