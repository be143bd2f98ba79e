"""``capturable=True`` on the Flash* classes: step counts on the device, GradScaler's unscale and
inf-skip inside the fused kernel, and a whole training iteration captured in a CUDA graph.

The reference is the same class with ``capturable=False`` (host step counts), under the
ordinary GradScaler loop where a scaler is used: parameters, codes, moments and step counts
must match bit for bit. The
kernel-level tests (every rule, per-tensor step counts, the bias-correction table) are in
memopt-kernels-triton's ``test_device_step.py``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from ecc_testutil import assert_same_state

from memopt_core.errors import ConfigError
from memopt_ecc import FlashAdamW, FlashLion, FlashSGD, FlashSGDW

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: class -> hyperparameters of the long runs
CASES = {
    FlashAdamW: {"lr": 1e-3, "weight_decay": 0.1},
    FlashLion: {"lr": 1e-4, "weight_decay": 0.1},
    FlashSGD: {"lr": 1e-2, "momentum": 0.9, "nesterov": True},
}
#: FlashSGDW's hyperparameters where a test adds it: decoupled decay, which lr scales
_SGDW = {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1}


def _params(dtype, seed=0, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 33), (33,), (1,), (257, 31), (4097,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype).to(device)) for s in shapes]


def test_capturable_needs_the_fused_path():
    p = [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]
    with pytest.raises(ConfigError, match="fused=False"):
        FlashAdamW(p, capturable=True, fused=False)
    with pytest.raises(ConfigError, match="capturable must be True or False"):
        FlashAdamW(p, capturable="yes")


def test_capturable_on_cpu_is_refused_before_any_change():
    # CPU tensors run on memopt-kernels-cpu or core's torch backend: neither keeps step counts
    # on the device
    p = [torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))]
    opt = FlashAdamW(p, capturable=True)
    p[0].grad = torch.ones_like(p[0])
    with pytest.raises(ConfigError, match="capturable=True needs a backend that keeps step"):
        opt.step()
    assert torch.equal(p[0].detach(), torch.ones(8, dtype=torch.bfloat16))


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)
def test_capturable_long_run_equals_host_steps(cls):
    """120 steps of bf16 parameters (ECC-24 + q8), every tenth without gradients on two
    tensors, against the host step."""
    a, b = _params(torch.bfloat16), _params(torch.bfloat16)
    ref, mine = cls(a, **CASES[cls]), cls(b, capturable=True, **CASES[cls])
    for step in range(1, 121):
        gen = torch.Generator().manual_seed(step)
        for i, (p, q) in enumerate(zip(a, b, strict=True)):
            g = torch.randn(p.shape, generator=gen).to(p.dtype).cuda()
            hold = step % 10 == 0 and i in (1, 3)
            p.grad = None if hold else g
            q.grad = None if hold else g.clone()
        ref.step()
        mine.step()
    assert_same_state(ref, a, mine, b)
    assert float(mine.state[b[0]]["step"]) == 120.0
    assert float(mine.state[b[1]]["step"]) == 108.0


def _scaler_inputs():
    """The loop's input and an inf, on the GPU (host copies: made before a sync-free loop)."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).cuda()
    return x, torch.full((), math.inf, device="cuda")


def _scaler_loop(model, opt, scaler, steps, bad_steps, inputs=None):
    sync_free = inputs is not None
    x, inf = inputs if sync_free else _scaler_inputs()
    for step in range(1, steps + 1):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().square().mean() * (1 + step % 3)
        scaler.scale(loss).backward()
        if step in bad_steps:
            grad = next(model.parameters()).grad.view(-1)
            if sync_free:  # a Python float written into a CUDA tensor is a host copy
                grad[step : step + 1].copy_(inf)
            else:
                grad[step] = math.inf
        scaler.step(opt)
        scaler.update()


class _ScalerLoopAdamW(FlashAdamW):
    """FlashAdamW as GradScaler treats an optimizer without in-kernel scaling: its ordinary loop
    (``unscale_``, a host read of the found-inf flag, ``step()`` skipped on an inf)."""

    _step_supports_amp_scaling = False


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("capturable", [True, False], ids=["capturable", "default"])
def test_grad_scaler_in_kernel_long_run(capturable):
    """fp16 autocast with fp32 parameters (GradScaler's use): 120 iterations with three
    non-finite ones; the optimizer (unscale and skip in the kernel, with or without
    ``capturable``) equals the ordinary GradScaler loop, scale included, and its scaled
    iterations never synchronise with the host (CUDA's sync debug mode raises on one)."""

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 31)
        ).cuda()

    m_ref, m_dev = build(), build()
    ref = _ScalerLoopAdamW(m_ref.parameters(), lr=1e-3)
    mine = FlashAdamW(m_dev.parameters(), lr=1e-3, capturable=capturable)
    s_ref = torch.amp.GradScaler("cuda", init_scale=2.0**14, growth_interval=7)
    s_dev = torch.amp.GradScaler("cuda", init_scale=2.0**14, growth_interval=7)
    bad = {5, 6, 40}
    _scaler_loop(m_ref, ref, s_ref, 120, bad)
    _scaler_loop(m_dev, mine, s_dev, 120, bad)
    assert_same_state(ref, list(m_ref.parameters()), mine, list(m_dev.parameters()))
    counts = mine.state[next(m_dev.parameters())]["step"]
    assert float(counts) == 117.0
    assert counts.device.type == "cuda"
    assert s_ref.get_scale() == s_dev.get_scale()
    # three more scaled iterations, one with an inf: any synchronisation raises
    inputs = _scaler_inputs()
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        # torch warns that the mode is a prototype that does not see every synchronisation
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        _scaler_loop(m_dev, mine, s_dev, 3, {2}, inputs=inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert float(mine.state[next(m_dev.parameters())]["step"]) == 119.0


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("set_to_none", [False, True], ids=["grads-kept", "torch-recipe"])
def test_whole_iteration_in_a_cuda_graph(set_to_none):
    """Forward, backward and ``opt.step()`` of a bf16 model (ECC-24 + q8) captured once and
    replayed on new data copied into the static input: the same bits as eager iterations.
    ``torch-recipe``: torch's whole-network recipe sets the gradients to None before the
    capture, so backward allocates them from the graph's pool, at addresses the step's tables
    meet first inside the capture."""

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)
        ).cuda()

    m_eager, m_graph = build(), build()
    for m in (m_eager, m_graph):
        m.to(torch.bfloat16)
    eager = FlashAdamW(m_eager.parameters(), lr=1e-3, weight_decay=0.1)
    graphed = FlashAdamW(m_graph.parameters(), lr=1e-3, weight_decay=0.1, capturable=True)
    data = [
        torch.randn(32, 64, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16).cuda()
        for s in range(12)
    ]
    static_x = data[0].clone()

    def iteration(model, opt, x):
        # False: grads stay in their buffers, a captured backward accumulates into them
        opt.zero_grad(set_to_none=set_to_none)
        model(x).float().square().mean().backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (torch's rule for capture): tables, counters, grads
        iteration(m_graph, graphed, static_x)
    torch.cuda.current_stream().wait_stream(side)
    iteration(m_eager, eager, data[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        iteration(m_graph, graphed, static_x)
    for x in data[1:]:
        static_x.copy_(x)
        graph.replay()
        iteration(m_eager, eager, x)
    torch.cuda.synchronize()
    assert_same_state(eager, list(m_eager.parameters()), graphed, list(m_graph.parameters()))
    assert float(graphed.state[next(m_graph.parameters())]["step"]) == 12.0


@pytest.mark.gpu
@_CUDA
def test_a_host_step_in_a_cuda_graph_is_refused():
    """capturable=False keeps step counts and bias corrections on the host: captured, every
    replay repeated the captured step and no count advanced, silently. Refused before any
    change; the same optimizer with capturable=True captures (the test above)."""
    params = _params(torch.bfloat16)
    opt = FlashAdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # warm: tables and state exist
    before = [p.detach().clone() for p in params]
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():  # the capture ends empty, and torch says so
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        with pytest.raises(ConfigError, match=r"captured in a CUDA graph, but .* capturable=False"):  # noqa: SIM117
            with torch.cuda.graph(graph):
                opt.step()
    for b, p in zip(before, params, strict=True):
        assert torch.equal(b, p.detach())
    assert float(opt.state[params[0]]["step"]) == 1.0
    opt.step()  # still usable eagerly
    assert float(opt.state[params[0]]["step"]) == 2.0


def _refused_capture(opt, match):
    """Capture ``opt.step()``, which must raise ConfigError matching ``match``."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with warnings.catch_warnings():  # the capture ends empty, and torch says so
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        with pytest.raises(ConfigError, match=match):  # noqa: SIM117
            with torch.cuda.graph(graph, stream=side):
                opt.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)
def test_first_step_in_a_capture_is_refused_before_any_change(cls):
    """A first step allocates state and copies tables from the host: captured, torch raised a
    RuntimeError about pageable copies (audit round 6's GPU probe). Refused before any change,
    and the optimizer then steps eagerly as one that never saw the capture."""
    params, ref = _params(torch.bfloat16), _params(torch.bfloat16)
    opt = cls(params, capturable=True, **CASES[cls])
    other = cls(ref, capturable=True, **CASES[cls])
    for p, q in zip(params, ref, strict=True):
        p.grad = torch.full_like(p, 0.25)
        q.grad = p.grad.clone()
    _refused_capture(opt, r"takes its first step inside a CUDA graph capture.*eager step")
    assert not opt.state
    assert all(torch.equal(p, q) for p, q in zip(params, ref, strict=True))
    opt.step()
    other.step()
    torch.cuda.synchronize()
    assert_same_state(opt, params, other, ref)


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize(
    ("cls", "decouple_lr"),
    [
        (FlashAdamW, False),
        (FlashAdamW, True),
        (FlashLion, False),
        (FlashLion, True),
        (FlashSGD, None),  # no decouple_lr: SGD's decay is L2, which lr does not scale
        (FlashSGDW, False),
        (FlashSGDW, True),
    ],
    ids=lambda v: (
        v.__name__ if isinstance(v, type) else {None: "-", False: "lr"}.get(v, "decouple_lr")
    ),
)
def test_a_cuda_tensor_lr_is_read_at_every_replay(cls, decouple_lr):
    """``opt.step()`` captured once with a CUDA tensor lr, replayed while a scheduler sets the
    tensor in place (``fill_``, as torch's schedulers do with a tensor lr): every replay uses
    the current value (the step size, the decoupled decay with ``decouple_lr``), the same bits
    as host steps given each value as a float. Before, such an lr was read with ``.item()``
    and refused under a capture."""
    hyper = dict(CASES.get(cls, _SGDW))
    lr0 = hyper.pop("lr")
    if decouple_lr is not None:
        hyper["decouple_lr"] = decouple_lr
    a, b = _params(torch.bfloat16), _params(torch.bfloat16)
    lr = torch.tensor(lr0, device="cuda")  # float32, as a scheduler's tensor lr often is
    ref = cls(a, lr=float(lr), **hyper)
    mine = cls(b, lr=lr, capturable=True, **hyper)
    _replays_follow(ref, a, mine, b, "lr", lr, [lr0 * f for f in (0.5, 2.0, 0.1, 1.0 / 3.0, 1.0)])


def _replays_follow(ref, a, mine, b, key, tensor, values):
    """Capture ``mine.step()`` once (after an eager step, which builds the tables a capture
    needs) and replay it while ``tensor`` (its group's ``key``) takes ``values`` in place;
    ``ref`` steps with each value as a float. Both end with the same bits."""

    def grads(step):
        gen = torch.Generator().manual_seed(step)
        for p, q in zip(a, b, strict=True):
            g = torch.randn(p.shape, generator=gen).to(p.dtype).cuda()
            p.grad = g
            if q.grad is None:
                q.grad = g.clone()
            else:
                q.grad.copy_(g)  # the graph reads these buffers

    grads(1)
    ref.step()
    mine.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mine.step()
    for step, value in enumerate(values, start=2):
        tensor.fill_(value)
        ref.param_groups[0][key] = float(tensor)  # the float32 value the tensor holds
        grads(step)
        ref.step()
        graph.replay()
    torch.cuda.synchronize()
    assert_same_state(ref, a, mine, b)
    assert float(mine.state[b[0]]["step"]) == 1.0 + len(values)


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize(
    "cls", [FlashAdamW, FlashLion, FlashSGD, FlashSGDW], ids=lambda c: c.__name__
)
def test_a_cuda_tensor_weight_decay_is_read_at_every_replay(cls):
    """A weight decay given as a CUDA tensor and changed in place between replays of one
    captured step (0 among the values): every replay decays (AdamW, Lion, SGDW) or adds the L2
    term (SGD) with the current value, the same bits as host steps given each value as a
    float. A float weight decay is fixed when the graph is captured."""
    hyper = dict(CASES.get(cls, _SGDW))
    hyper["weight_decay"] = wd0 = 0.1
    a, b = _params(torch.bfloat16), _params(torch.bfloat16)
    wd = torch.tensor(wd0, device="cuda")
    ref = cls(a, **hyper)
    mine = cls(b, **{**hyper, "weight_decay": wd}, capturable=True)
    _replays_follow(ref, a, mine, b, "weight_decay", wd, [0.0, 0.5, wd0 / 3, 0.0, wd0])


@pytest.mark.gpu
@_CUDA
def test_a_cuda_initial_lr_beside_a_float_lr_in_a_capture_is_refused():
    """With decouple_lr, a CUDA tensor initial_lr beside a float lr would be read on the host
    under the capture: refused, naming it, before any change; eager steps with it work."""
    params = _params(torch.bfloat16)
    opt = FlashAdamW(params, lr=1e-3, decouple_lr=True, weight_decay=0.1, capturable=True)
    opt.param_groups[0]["initial_lr"] = torch.tensor(1e-3, device="cuda")
    for p in params:
        p.grad = torch.full_like(p, 0.25)
    opt.step()
    before = [p.detach().clone() for p in params]
    _refused_capture(opt, r"param group 0: initial_lr is a tensor on cuda:0 but lr is not")
    assert all(torch.equal(b, p) for b, p in zip(before, params, strict=True))
    assert float(opt.state[params[0]]["step"]) == 1.0


def _eager_twin_and_captured(new_addresses=True):
    """Two FlashAdamW(capturable=True) over the same parameters, one eager step each with
    gradients 0.25; the second then captures its step in a graph, with new gradient tensors
    (at new addresses: tables made inside the capture) or the eager step's (tables made before
    it). Returns (twin, its params, captured, its params, graph)."""
    sets = [_params(torch.bfloat16), _params(torch.bfloat16)]
    opts = [FlashAdamW(ps, lr=1e-3, weight_decay=0.1, capturable=True) for ps in sets]
    for opt, ps in zip(opts, sets, strict=True):
        for p in ps:
            p.grad = torch.full_like(p, 0.25)
        opt.step()
    params = sets[1]
    keep = [p.grad for p in params]  # held, so the new gradients get new addresses
    if new_addresses:
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        assert all(p.grad.data_ptr() != k.data_ptr() for p, k in zip(params, keep, strict=True))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        opts[1].step()
    torch.cuda.current_stream().wait_stream(side)
    return opts[0], sets[0], opts[1], params, graph


def _replay_against_twin(twin, twin_params, opt, params, graph, values):
    """Replay ``graph`` with the captured gradients filled with each of ``values`` in place,
    and step ``twin`` eagerly on the same gradients."""
    for v in values:
        for p in params:
            p.grad.fill_(v)
        graph.replay()
        for p in twin_params:
            p.grad = torch.full_like(p, v)
        twin.step()
    torch.cuda.synchronize()


@pytest.mark.gpu
@_CUDA
def test_a_capture_with_gradients_at_new_addresses_replays_them():
    """Gradients at new addresses need a new slot table, which the capture copies from the
    host: the graph repeats that copy from a held host table at every replay (refused before
    2026-12-06, as torch's whole-network recipe needs it). Same bits as eager steps."""
    twin, twin_params, opt, params, graph = _eager_twin_and_captured()
    _replay_against_twin(twin, twin_params, opt, params, graph, (0.5, -1.5, 3.0))
    assert_same_state(twin, twin_params, opt, params)
    assert float(opt.state[params[0]]["step"]) == 4.0


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("new_addresses", [True, False], ids=["made-in-capture", "made-before"])
def test_tables_a_graph_reads_outlive_the_table_caches(new_addresses):
    """Eager steps over many other gradient buffers after the capture push its tables out of
    the optimizer's caches; the graph still reads them, so they are held: replays after 40 such
    steps (each with fresh gradients, and the twin with the same values) keep the same bits.
    Tables made before the capture lived in the caching allocator's ordinary pool, where the
    fresh steps' tables would take their memory once freed."""
    twin, twin_params, opt, params, graph = _eager_twin_and_captured(new_addresses)
    captured_grads = [p.grad for p in params]
    gen = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(40):
        values = [torch.randn(p.shape, generator=gen, device="cuda") for p in params]
        for o, ps in ((opt, params), (twin, twin_params)):
            for p, v in zip(ps, values, strict=True):
                p.grad = v.to(p.dtype)  # a new buffer each step
            o.step()
    for p, g in zip(params, captured_grads, strict=True):
        p.grad = g  # the graph's own buffers again, for the hand-written replays below
    _replay_against_twin(twin, twin_params, opt, params, graph, (0.75, -0.25))
    assert_same_state(twin, twin_params, opt, params)
    assert float(opt.state[params[0]]["step"]) == 43.0


@pytest.mark.gpu
@_CUDA
def test_a_capture_after_a_beta2_change_is_refused_before_any_change():
    """q8 second moments are stored divided by beta2's decay: a new beta2 re-encodes them once,
    at the next step. Captured, that conversion would run again at every replay: refused, and
    the next eager step converts them."""
    params = _params(torch.bfloat16)
    opt = FlashAdamW(params, lr=1e-3, capturable=True)
    for p in params:
        p.grad = torch.full_like(p, 0.25)
    opt.step()
    opt.param_groups[0]["betas"] = (0.9, 0.99)
    before = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    _refused_capture(opt, r"beta2 changed to 0\.99 .* take one eager step")
    assert all(
        torch.equal(b, opt.state[p]["exp_avg_sq"]) for b, p in zip(before, params, strict=True)
    )
    opt.step()
    assert float(opt.state[params[0]]["step"]) == 2.0


_RELEASE_WITH_SCALER = r"""
import copy, math, sys
sys.path.insert(0, sys.argv[1])
import torch
from ecc_testutil import assert_same_state
from test_gradient_release import batches, loss_fn, make_model, params_of
from memopt_ecc import FlashAdamW, enable_gradient_release

# per parameter: only mix.weight skips; one bucket (the default): all 5 trainable tensors skip
for bucket_mb, skipped in ((0, 1), (32, 5)):
    runs = []
    for capturable in (False, True):
        model = make_model("cpu")
        opt = FlashAdamW(model.parameters(), lr=1e-2, capturable=capturable)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
        handle = enable_gradient_release(model, opt, grad_scaler=scaler, bucket_mb=bucket_mb)
        for i, idx in enumerate(batches("cpu", n=6)):
            hook = model.mix.weight.register_hook(lambda g: g * math.inf) if i == 2 else None
            scaler.scale(loss_fn(model, idx)).backward()
            if hook is not None:
                hook.remove()
            scaler.update()
        runs.append((model, opt, scaler, handle))
    (m0, o0, s0, h0), (m1, o1, s1, h1) = runs
    assert_same_state(o0, params_of(m0), o1, params_of(m1))
    assert h0.skipped == h1.skipped == skipped, (h0.skipped, h1.skipped)
    assert s0.get_scale() == s1.get_scale(), (s0.get_scale(), s1.get_scale())
    assert float(o1.state[m1.mix.weight]["step"]) == 5.0
print("same bits")
"""


def test_release_with_grad_scaler_skips_on_the_device(tmp_path):
    """Gradient release with a GradScaler and a capturable optimizer: the hooks hand the
    found-inf flag to the kernel instead of reading it (no synchronisation per parameter), with
    the bits, the skipped count and the scale of the synchronising path. The Triton kernels run
    in the interpreter here, in a fresh process (Triton reads TRITON_INTERPRET at import)."""
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("memopt_kernels_triton") is None:
        pytest.skip("needs memopt-kernels-triton (the only backend with device step counts)")
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("numpy") is None:
        pytest.skip("needs triton and numpy (the interpreter)")
    script = tmp_path / "release_scaler.py"
    script.write_text(_RELEASE_WITH_SCALER)
    env = {**os.environ, "TRITON_INTERPRET": "1", "MEMOPT_BACKEND": "triton"}
    tests = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, str(script), tests], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "same bits" in done.stdout


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize(("bucket_mb", "per_inf"), [(0, 1), (32, 4)])
def test_release_with_grad_scaler_on_cuda(bucket_mb, per_inf):
    """The CUDA twin of the interpreter test above, with fp32 parameters under fp16 autocast
    (torch's GradScaler has no bf16 inf check on CUDA): release with a capturable optimizer
    equals release with the synchronising path, skipped count and scale included (per
    parameter: one skipped per inf step; one bucket: all 4 tensors)."""
    from memopt_ecc import enable_gradient_release

    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).cuda()
    runs = []
    for capturable in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 31)
        ).cuda()
        opt = FlashAdamW(model.parameters(), lr=1e-3, capturable=capturable)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**14, growth_interval=7)
        handle = enable_gradient_release(model, opt, grad_scaler=scaler, bucket_mb=bucket_mb)
        for step in range(1, 31):
            hook = None
            if step in (5, 6, 20):
                hook = model[0].weight.register_hook(lambda g: g * math.inf)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().square().mean() * (1 + step % 3)
            scaler.scale(loss).backward()
            if hook is not None:
                hook.remove()
            scaler.update()
        runs.append((model, opt, scaler, handle))
    (m0, o0, s0, h0), (m1, o1, s1, h1) = runs
    assert_same_state(o0, list(m0.parameters()), o1, list(m1.parameters()))
    assert h0.skipped == h1.skipped == 3 * per_inf
    assert s0.get_scale() == s1.get_scale()
