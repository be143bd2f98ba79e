"""``AdamBridge(update="device")`` against the reference, bit for bit: the state in host memory,
the update on the device (on a CPU model: the same buckets, copies and launches, through the C++
kernels). Buckets that cut parameters into pieces, odd sizes, mixed dtypes, non-contiguous
parameters, parameters that miss a step, state dicts (also across ``update="host"``), and the
errors of bad configurations. Clipping, accumulation, schedulers, groups, tied and frozen
weights, many tiny tensors and attach/detach run both updates in test_bridge_exact.py and
test_bridge_usage.py (``both_updates``)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from offload_testutil import (
    OddSizes,
    Reference,
    assert_same_params,
    batch,
    loss_of,
    make_model,
    step_pair,
    train_pair,
)

from memopt_core.errors import ConfigError, OffloadError, StateDictError
from memopt_offload import AdamBridge
from memopt_offload.bridge import _Dispatcher

PRECISION = "bf16-ecc24"
#: 2 KiB of gradients per bucket: the 33x48 and 48x31 weights are cut into pieces
TINY_BUCKETS = 0.002


def device_bridge(params, **kw) -> AdamBridge:
    kw.setdefault("lr", 3e-3)
    return AdamBridge(params, precision=PRECISION, update="device", **kw)


@pytest.mark.parametrize("bucket_mb", [32.0, TINY_BUCKETS], ids=["whole", "pieces"])
@pytest.mark.parametrize("hooks", [True, False], ids=["hooks", "step"])
def test_matches_reference_120_steps(device, hooks, bucket_mb):
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt = device_bridge(model.parameters(), weight_decay=0.05, bucket_mb=bucket_mb)
    if bucket_mb == TINY_BUCKETS:  # the test must cut a parameter into pieces
        assert any(len(b.members) == 1 and b.starts[0] > 0 for b in opt._dev.buckets)
    ref = Reference(ref_model, PRECISION, lr=3e-3, weight_decay=0.05)
    train_pair(model, ref_model, opt, ref, 120, device, hooks=hooks)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        master = ref.masters[id(q)]
        code = ref.opt.state[master]["master_code"]
        assert torch.equal(opt.master_weight(p), _decode(master.detach(), code))
    # the state moved: stalled moments or skipped updates would leave the weights at init
    init = make_model(device)
    assert all(
        not torch.equal(p, p0) for p, p0 in zip(model.parameters(), init.parameters(), strict=True)
    )


def _decode(weight, code):
    from memopt_kernels_cpu import ops

    return ops.decode_master("ecc24", weight, code)


def test_state_matches_reference_state(device):
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt = device_bridge(model.parameters(), bucket_mb=TINY_BUCKETS)
    ref = Reference(ref_model, PRECISION, lr=3e-3)
    train_pair(model, ref_model, opt, ref, 15, device, hooks=True)
    sd = opt.state_dict()
    for i, q in enumerate(ref_model.parameters()):
        rs = ref.opt.state[ref.masters[id(q)]]
        for key in ("exp_avg", "exp_avg_sq", "master_code"):
            assert torch.equal(sd["state"][i][key], rs[key]), key
        assert sd["state"][i]["step"].item() == rs["step"].item() == 15


def test_float32_parameters(device):
    # float32 parameters are their own master: bf16 moments only
    model = make_model(device, dtype=torch.float32)
    ref_model = copy.deepcopy(model)
    opt = device_bridge(model.parameters(), lr=1e-3, bucket_mb=TINY_BUCKETS)
    assert opt.state_bytes() == 4 * sum(p.numel() for p in model.parameters())
    ref = Reference(ref_model, PRECISION, lr=1e-3)
    train_pair(model, ref_model, opt, ref, 12, device, hooks=True, dtype=torch.float32)


def test_master_weight_is_a_copy(device):
    # a float32 parameter is its own master: on a CPU model the copy is the only one made
    model = make_model(device, dtype=torch.float32)
    opt = device_bridge(model.parameters())
    before = model[0].weight.detach().clone()
    master = opt.master_weight(model[0].weight)
    assert torch.equal(master, before.cpu())
    master.add_(1.0)
    assert torch.equal(model[0].weight, before)


@pytest.mark.parametrize("hooks", [True, False], ids=["hooks", "step"])
def test_odd_sizes(device, hooks):
    torch.manual_seed(0)
    model = OddSizes().to(device=device, dtype=torch.bfloat16)
    ref_model = copy.deepcopy(model)
    opt = device_bridge(model.parameters(), lr=1e-2, bucket_mb=0.00005)  # 26 elements a bucket
    ref = Reference(ref_model, PRECISION, lr=1e-2)
    if hooks:
        opt.attach_hooks(model)
    xs = [batch(t, device, n=1, d=33).reshape(-1) for t in range(5)]
    step_pair(model, ref_model, opt, ref, xs, hooks=hooks)


class Upcast(torch.nn.Module):
    """``module`` (float32 parameters) on float32 inputs inside a bfloat16 model: CUDA's layer
    norm refuses mixed dtypes."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module.float()

    def forward(self, x):
        return self.module(x.float()).to(x.dtype)


def test_mixed_dtypes_in_one_group(device):
    # bf16 weights (ECC-24 master) and fp32 LayerNorm parameters: one region per dtype, the
    # host update's tensor ids across both
    model = make_model(device)
    model[2] = Upcast(model[2])
    ref_model = copy.deepcopy(model)
    opt = device_bridge(model.parameters(), bucket_mb=TINY_BUCKETS)
    assert [r.plan.param_dtype for r in opt._dev.regions] == [torch.bfloat16, torch.float32]
    ref = Reference(ref_model, PRECISION, lr=3e-3)
    train_pair(model, ref_model, opt, ref, 20, device, hooks=True)


class Transposed(torch.nn.Module):
    """A weight held transposed: a non-contiguous parameter (never cut into pieces)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(31, 33).t())

    def forward(self, x):
        return x @ self.w


def test_non_contiguous_parameter(device):
    torch.manual_seed(7)
    model = Transposed().to(device=device, dtype=torch.bfloat16)
    assert not model.w.is_contiguous()
    ref_model = copy.deepcopy(model)
    opt = device_bridge(model.parameters(), bucket_mb=0.0005)  # smaller than the weight
    ref = Reference(ref_model, PRECISION, lr=3e-3)
    train_pair(model, ref_model, opt, ref, 10, device, hooks=True)
    assert not model.w.is_contiguous()  # updated in place, layout kept


class _Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(16, 32, 3)  # 4608 weights: pieces of TINY_BUCKETS
        self.head = torch.nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


@pytest.mark.parametrize("how", ["p.data", "channels_last"])
def test_parameters_given_new_memory_are_trained(device, how):
    """A weight larger than a bucket is cut into pieces, views of its memory. After ``p.data =
    t`` or ``model.to(memory_format=torch.channels_last)`` the pieces' updates went on into the
    old memory: the weight never trained again, and nothing said so. Its buckets are now cut
    again over the new memory (a non-contiguous weight whole)."""
    torch.manual_seed(0)
    model = _Conv().to(device=device, dtype=torch.bfloat16)
    ref_model = copy.deepcopy(model)
    opt = device_bridge(model.parameters(), bucket_mb=TINY_BUCKETS)
    assert any(b.starts[0] > 0 for b in opt._dev.buckets)
    ref = Reference(ref_model, PRECISION, lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 16, 6, 6, generator=gen).to(device, torch.bfloat16) for _ in range(6)]
    opt.attach_hooks(model)
    step_pair(model, ref_model, opt, ref, xs[:2], loss=loss_of)
    before = model.conv.weight.detach().clone()
    if how == "p.data":
        for p in model.parameters():
            p.data = p.data.clone()
    else:
        model.to(memory_format=torch.channels_last)
        assert not model.conv.weight.is_contiguous()
    step_pair(model, ref_model, opt, ref, xs[2:], loss=loss_of, start=2)
    assert not torch.equal(model.conv.weight, before)


def test_a_parameter_moved_to_another_device_is_refused(device):
    """Moved after the optimizer was built: refused when the step opens, naming the parameter,
    where the device update failed inside its kernels ("an update failed ... reload the last
    checkpoint") though nothing had been updated."""
    model = make_model(device)
    opt = device_bridge(model.parameters())
    # cuda:0 -> cuda:1 assigns p.data (compatible tensor types); with one device here, the
    # optimizer is told it was built for another one instead
    opt._device = torch.device("meta")
    model[0].weight.data = model[0].weight.data.clone()
    with pytest.raises(
        OffloadError,
        match=rf"parameter #0 of param group 0 .* is on {device}.* built for parameters on meta",
    ):
        opt._check_moved()


def test_dispatcher_thread_runs_without_grad_mode():
    # grad mode is per thread and on in a new one: the updates it runs write parameters in
    # place (a strided parameter is written back with copy_, which autograd refuses on a leaf)
    dispatcher = _Dispatcher(newest_first=False)
    seen = []
    bucket = SimpleNamespace(done=False)
    dispatcher.submit(bucket, lambda b: seen.append(torch.is_grad_enabled()))
    assert dispatcher.wait() is None
    dispatcher.stop()
    assert torch.is_grad_enabled()
    assert seen == [False]
    assert bucket.done


class SometimesUnused(torch.nn.Module):
    """``extra`` takes part in even steps only, and shares a bucket with ``main``."""

    def __init__(self) -> None:
        super().__init__()
        self.main = torch.nn.Linear(33, 8)
        self.extra = torch.nn.Linear(33, 8)
        self.use_extra = True

    def forward(self, x):
        y = self.main(x)
        return y + self.extra(x) if self.use_extra else y


def test_parameters_that_miss_steps(device):
    torch.manual_seed(6)
    model = SometimesUnused().to(device=device, dtype=torch.bfloat16)
    ref_model = copy.deepcopy(model)
    opt = device_bridge(model.parameters())
    assert len(opt._dev.buckets) == 1
    ref = Reference(ref_model, PRECISION, lr=3e-3)
    opt.attach_hooks(model)
    for t in range(7):
        for m in (model, ref_model):
            m.use_extra = t % 2 == 0
            loss_of(m, batch(t, device)).backward()
        opt.step_sync()
        ref.step()
        ref_model.zero_grad()
        assert_same_params(model, ref_model, f"step {t}")
    sd = opt.state_dict()["state"]
    assert [sd[i]["step"].item() for i in range(4)] == [7, 7, 4, 4]


@pytest.mark.parametrize("where", ["wait", "norm"])
def test_retried_step_sync_runs_each_bucket_once(device, where, monkeypatch):
    """A step_sync() interrupted after it dispatched the bucket that a parameter without a
    gradient left unfinished (Ctrl-C while it waits, or while the norm is read): the retry only
    collects. A second run staged the bucket again before its write-back landed (on CUDA its
    host state went back to the pre-step values)."""
    from memopt_offload.device_update import DeviceUpdater

    runs = []
    real_run = DeviceUpdater.run

    def counting_run(self, b, groups, coef):
        runs.append(id(b))
        return real_run(self, b, groups, coef)

    monkeypatch.setattr(DeviceUpdater, "run", counting_run)
    torch.manual_seed(6)
    model = SometimesUnused().to(device=device, dtype=torch.bfloat16)
    ref_model = copy.deepcopy(model)
    clip = {"max_grad_norm": 1e9} if where == "norm" else {}
    opt = device_bridge(model.parameters(), **clip)
    ref = Reference(ref_model, PRECISION, lr=3e-3)
    opt.attach_hooks(model)
    model.use_extra = ref_model.use_extra = False  # "extra" gets no gradient: bucket unfinished
    x = batch(0, device)
    loss_of(model, x).backward()
    loss_of(ref_model, x).backward()
    cls, name = (_Dispatcher, "wait") if where == "wait" else (AdamBridge, "_norm_stream")
    real = getattr(cls, name)

    def interrupt_once(self):
        monkeypatch.setattr(cls, name, real)
        raise KeyboardInterrupt("simulated Ctrl-C")

    monkeypatch.setattr(cls, name, interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        opt.step_sync()
    opt.step_sync()  # the user retries
    ref.step()
    assert len(runs) == len(set(runs)) == 1
    assert_same_params(model, ref_model, where)
    sd = opt.state_dict()["state"]
    assert [sd[i]["step"].item() for i in range(4)] == [1, 1, 0, 0]
    for i, q in enumerate([ref_model.main.weight, ref_model.main.bias]):
        rs = ref.opt.state[ref.masters[id(q)]]  # written back once, after the update
        for key in ("exp_avg", "exp_avg_sq", "master_code"):
            assert torch.equal(sd[i][key], rs[key]), key


def test_state_dict_resume_and_across_updates(device, tmp_path):
    """A device-update checkpoint resumes bit-identically, and loads into ``update="host"``
    (and back): the two keep the same state in the same layout."""

    def build(update, seed=0):
        model = make_model(device, seed=seed)
        opt = AdamBridge(
            model.parameters(), lr=2e-3, precision=PRECISION, seed=7, update=update,
            bucket_mb=TINY_BUCKETS,
        )  # fmt: skip
        opt.attach_hooks(model)
        return model, opt

    def train(model, opt, steps):
        for t in steps:
            loss_of(model, batch(t, device)).backward()
            opt.step_sync()

    straight, sopt = build("device")
    train(straight, sopt, range(10))

    first, fopt = build("device")
    train(first, fopt, range(6))
    torch.save({"model": first.state_dict(), "opt": fopt.state_dict()}, tmp_path / "ck.pt")
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    for update in ("device", "host"):
        resumed, ropt = build(update, seed=99)  # everything must come from the checkpoint
        ropt.load_state_dict(ck["opt"])  # the weights too: "master" holds them
        train(resumed, ropt, range(6, 10))
        assert_same_params(straight, resumed, f"resumed with update={update!r}")
    # and a host-update checkpoint into a device update
    host, hopt = build("host")
    train(host, hopt, range(6))
    back, bopt = build("device", seed=99)
    bopt.load_state_dict(hopt.state_dict())
    train(back, bopt, range(6, 10))
    assert_same_params(straight, back, "host checkpoint resumed with update='device'")


def test_a_partial_state_dict_restarts_the_same_state_in_either_update(device):
    """A state dict without entries for some trainable parameters: the device update restarts
    them (step 0, zero moments, the code of the current weight); the host update left them
    without host state, so its next state_dict() could not be loaded. Both now hold the same
    bits after the load and after three more steps."""
    results = {}
    for update in ("device", "host"):
        model = make_model(device)
        opt = AdamBridge(model.parameters(), lr=1e-2, precision=PRECISION, update=update, seed=3)
        for t in range(3):
            loss_of(model, batch(t, device)).backward()
            opt.step()
            opt.zero_grad()
        sd = copy.deepcopy(opt.state_dict())
        del sd["state"][0], sd["state"][3]
        opt.load_state_dict(sd)
        loaded = copy.deepcopy(opt.state_dict())
        for t in range(3, 6):
            loss_of(model, batch(t, device)).backward()
            opt.step()
            opt.zero_grad()
        results[update] = loaded, opt.state_dict(), model
    (dev_loaded, dev_sd, dev_model), (host_loaded, host_sd, host_model) = results.values()
    assert [e["step"].item() for e in host_loaded["state"].values()] == [0, 3, 3, 0, 3, 3]
    for a, b in ((dev_loaded, host_loaded), (dev_sd, host_sd)):
        assert a["state"].keys() == b["state"].keys()
        for i, entry in a["state"].items():
            assert entry.keys() == b["state"][i].keys(), i
            for k, v in entry.items():
                assert torch.equal(b["state"][i][k], v), (i, k)
    assert_same_params(dev_model, host_model, "after the partial load and three steps")


def test_bad_state_dict_changes_nothing(device):
    model = make_model(device)
    opt = device_bridge(model.parameters())
    opt.attach_hooks(model)
    loss_of(model, batch(0, device)).backward()
    opt.step_sync()
    sd = opt.state_dict()
    before = copy.deepcopy(sd)
    weights = [p.detach().clone() for p in model.parameters()]
    bad = copy.deepcopy(sd)
    bad["state"][3]["exp_avg"] = bad["state"][3]["exp_avg"].float()
    bad["state"][0]["master"] = torch.zeros_like(bad["state"][0]["master"])
    with pytest.raises(StateDictError, match="'exp_avg' of parameter index 3 must be"):
        opt.load_state_dict(bad)
    missing = copy.deepcopy(sd)
    del missing["state"][1]["master_code"]
    with pytest.raises(StateDictError, match="lacks \\['master_code'\\]"):
        opt.load_state_dict(missing)
    after = opt.state_dict()
    for i, entry in before["state"].items():
        for k, v in entry.items():
            assert torch.equal(after["state"][i][k], v), (i, k)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def test_memory_and_grads(device):
    model = make_model(device)
    n = sum(p.numel() for p in model.parameters())
    opt = device_bridge(model.parameters())
    assert opt.state_bytes() == 5 * n  # ECC-24 code + bf16 m and v
    assert opt.state_bytes() <= opt.host_bytes() < 5 * n + 4096
    assert opt.pinned_bytes() == (opt.host_bytes() if device.type == "cuda" else 0)
    opt.attach_hooks(model)
    loss_of(model, batch(0, device)).backward()
    with pytest.raises(OffloadError, match="step_sync"):
        model(batch(1, device))  # the updates of the last backward were not collected
    opt.step_sync()
    assert all(p.grad is None for p in model.parameters())
    opt.step_sync()  # a second call without new gradients does nothing
    model(batch(1, device))


def test_bad_configurations(device):
    model = make_model(device)
    with pytest.raises(ConfigError, match="update must be one of"):
        AdamBridge(model.parameters(), precision=PRECISION, update="gpu")
    with pytest.raises(ConfigError, match=r"precision='bf16-ecc24'.*got precision='bf16'"):
        AdamBridge(model.parameters(), precision="bf16", update="device")
    for bad in (-1, float("nan"), True, "8"):
        with pytest.raises(ConfigError, match="prefetch_mb"):
            device_bridge(model.parameters(), prefetch_mb=bad)
    opt = device_bridge(model.parameters())
    assert opt.bucket_bytes == 64 * 2**20  # the device update's default (32 on the host)
    assert AdamBridge(model.parameters(), precision=PRECISION).bucket_bytes == 32 * 2**20
    with pytest.raises(ConfigError, match="overlap_forward is for update='host'"):
        opt.attach_hooks(model, overlap_forward=True)
    assert not opt.hooks_attached


@pytest.mark.parametrize("where", ["arrived", "norm"])
def test_a_hook_interrupted_before_the_handover_keeps_the_gradient(device, where, monkeypatch):
    """An exception in the hook (an OOM in the clipping norm, Ctrl-C) after it had taken the
    gradient off the parameter and before the bucket counted it lost that gradient: the step
    ran without it, with no message. It stays on the parameter now, and step_sync() takes it."""
    from memopt_offload.device_update import DeviceUpdater

    model = make_model(device)
    ref_model = copy.deepcopy(model)
    n = sum(1 for _ in model.parameters())
    opt = device_bridge(model.parameters(), bucket_mb=TINY_BUCKETS, max_grad_norm=1e9)
    ref = Reference(ref_model, PRECISION, lr=3e-3)
    opt.attach_hooks(model)
    calls = []
    cls, name = (DeviceUpdater, "arrived") if where == "arrived" else (torch.linalg, "vector_norm")
    real = getattr(cls, name)

    def interrupt_last(*args, **kwargs):
        calls.append(None)
        if len(calls) == n:  # the last hook of backward: every gradient exists
            raise KeyboardInterrupt("simulated Ctrl-C")
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, interrupt_last)
    x = batch(0, device)
    with pytest.raises(KeyboardInterrupt):
        loss_of(model, x).backward()
    monkeypatch.setattr(cls, name, real)
    assert sum(p.grad is not None for p in model.parameters()) == 1
    loss_of(ref_model, x).backward()
    expected_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in ref_model.parameters()])
    ).item()
    assert opt.step_sync() == pytest.approx(expected_norm, rel=1e-5)
    ref.step()
    assert all(p.grad is None for p in model.parameters())
    assert_same_params(model, ref_model)
    assert all(s["step"].item() == 1 for s in opt.state_dict()["state"].values())


def test_a_failed_update_waits_for_the_streams_before_freeing(device, monkeypatch):
    """A run that raised after its launch (and before its write-back) freed the staged state
    and the gradients with no mark of the update stream, and abandon() left that stream
    unordered: a queued kernel could use reused memory, or write the weights after a reload.
    The buffers are marked before the first launch now, and abandon() waits for the streams
    while it still holds the step's gradients. The reload then trains as a fresh run."""
    from memopt_offload.device_update import DeviceUpdater

    cuda = device.type == "cuda"
    model = make_model(device)
    ref_model = copy.deepcopy(model)
    opt = device_bridge(model.parameters(), bucket_mb=TINY_BUCKETS)
    opt.attach_hooks(model)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    syncs, launched, recorded = [], [], set()
    real_sync, real_launch = DeviceUpdater.synchronize_host, DeviceUpdater._launch

    def sync(self):
        syncs.append(len(self._step.arrived))  # the step's gradients, still held
        real_sync(self)

    def failing_launch(self, b, staged, *args):
        if cuda:
            torch.cuda._sleep(100_000_000)  # on the update stream: the kernel is still queued
        real_launch(self, b, staged, *args)
        launched.append([t.data_ptr() in recorded for t in staged.tensors()])
        raise RuntimeError("simulated failure after the launch")

    if cuda:
        real_record = torch.Tensor.record_stream

        def record_stream(t, stream):
            recorded.add(t.data_ptr())
            real_record(t, stream)

        monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    monkeypatch.setattr(DeviceUpdater, "synchronize_host", sync)
    monkeypatch.setattr(DeviceUpdater, "_launch", failing_launch)
    loss_of(model, batch(0, device)).backward()
    with pytest.raises(OffloadError, match="simulated failure after the launch"):
        opt.step_sync()
    assert len(launched) == 1
    if cuda:
        assert all(launched[0])  # marked for the streams before the launch
        assert all(s.query() for s in opt._dev._streams)
    assert syncs
    assert syncs[0] > 0  # abandon() waited before the gradients went
    monkeypatch.setattr(DeviceUpdater, "_launch", real_launch)
    opt.load_state_dict(saved_opt)
    model.load_state_dict(saved_model)
    ref_opt = device_bridge(ref_model.parameters(), bucket_mb=TINY_BUCKETS)
    ref_opt.attach_hooks(ref_model)
    for m, o in ((model, opt), (ref_model, ref_opt)):
        loss_of(m, batch(1, device)).backward()
        o.step_sync()
    assert_same_params(model, ref_model)


@pytest.mark.parametrize("prefetch_mb", [0.0, 1e-6, 64.0], ids=["zero", "tiny", "all"])
def test_prefetch_budget(device, prefetch_mb, monkeypatch):
    """prefetch_mb=0 ("none") still staged one bucket ahead when nothing was in flight. The
    buckets _prefetch would stage at the start of a step (on a CPU model it runs as on CUDA
    here: staging itself is stubbed out)."""
    model = make_model(device)
    opt = device_bridge(model.parameters(), bucket_mb=TINY_BUCKETS, prefetch_mb=prefetch_mb)
    opt.attach_hooks(model)
    loss_of(model, batch(0, device)).backward()
    opt.step_sync()
    dev = opt._dev
    assert len(dev.order) > 2
    for b in dev.buckets:  # as the next step's _open leaves them
        b.ran = False
    staged = []
    monkeypatch.setattr(dev, "_stage", staged.append)
    dev.synchronize_host()  # no write-back in flight counts against the budget
    if device.type != "cuda":
        monkeypatch.setattr(dev, "device", SimpleNamespace(type="cuda"))
    dev._prefetch()
    expected = {0.0: 0, 1e-6: 1, 64.0: len(dev.order)}[prefetch_mb]
    assert staged == dev.order[:expected]


@pytest.mark.gpu
def test_prefetch_follows_the_last_order(device):
    if device.type != "cuda":
        pytest.skip("prefetching overlaps copies with backward on a CUDA device")
    model = make_model(device, width=512)
    ref_model = copy.deepcopy(model)
    opt = device_bridge(model.parameters(), bucket_mb=0.01, prefetch_mb=0.02)
    assert len(opt._dev.buckets) > 8
    ref = Reference(ref_model, PRECISION, lr=3e-3)
    opt.attach_hooks(model)
    for t in range(5):
        x = batch(t, device)
        loss_of(model, x).backward()
        loss_of(ref_model, x).backward()
        if t == 0:
            assert not opt._dev.order  # nothing to prefetch from yet
        opt.step_sync()
        ref.step()
        ref_model.zero_grad()
        assert_same_params(model, ref_model, f"step {t}")
    # backward's order: the last parameters' buckets ran first
    order = [b.members[0] for b in opt._dev.order]
    assert order[0] > order[-1]
