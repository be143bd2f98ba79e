"""The Flash* classes: FlashOptim's constructor, the mapping onto core's formats (bit for bit equal
to the mapped MemOptimizer), bytes per parameter, mixed dtypes, non-contiguous parameters,
``fused``, ``compress_state_dict``, param-group keys, copies."""

from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch
from ecc_testutil import assert_same_state, same_bits

from memopt_core import ConfigError, MemOptimizer, StateDictError, backends
from memopt_core.torch_backend import TorchBackend
from memopt_ecc import (
    MASTER_WEIGHT_BITS,
    FlashAdam,
    FlashAdamW,
    FlashLion,
    FlashOptimizer,
    FlashSGD,
    FlashSGDW,
    fp32_master,
    get_fp32_model_state_dict,
)

# FlashOptim 0.1.4's positional parameters and defaults (flashoptim/optimizers.py)
_COMMON = dict(
    quantize=True,
    compress_state_dict=True,
    master_weight_bits=24,
    check_numerics=False,
    fused=True,
)
FLASHOPTIM = {
    FlashSGD: dict(
        lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, **_COMMON
    ),
    FlashSGDW: dict(
        lr=1e-3,
        momentum=0.0,
        dampening=0.0,
        weight_decay=0.0,
        nesterov=False,
        decouple_lr=False,
        **_COMMON,
    ),
    FlashAdam: dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **_COMMON),
    FlashAdamW: dict(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, decouple_lr=False, **_COMMON
    ),
    FlashLion: dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0, decouple_lr=False, **_COMMON),
}
RULE = {
    FlashSGD: "sgd",
    FlashSGDW: "sgdw",
    FlashAdam: "adam",
    FlashAdamW: "adamw",
    FlashLion: "lion",
}
# per-class hyperparameters that exercise the rule (momentum, decay, decouple_lr)
HYPER = {
    FlashSGD: dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
    FlashSGDW: dict(lr=1e-2, momentum=0.8, dampening=0.1, weight_decay=0.1, decouple_lr=True),
    FlashAdam: dict(lr=1e-2, weight_decay=0.1),
    FlashAdamW: dict(lr=1e-2, weight_decay=0.1, decouple_lr=True),
    FlashLion: dict(lr=1e-3, weight_decay=0.5),
}


def _noncontiguous(rows: int, cols: int, gen: torch.Generator, dtype=torch.bfloat16):
    t = torch.empty_strided((rows, cols), (1, rows), dtype=dtype)
    t.copy_(torch.randn(rows, cols, generator=gen))
    return t


def make_params(device, seed=0, half=torch.bfloat16):
    """``half`` (bf16, or fp16) and fp32 parameters in one list, one of them non-contiguous (a
    transposed layout)."""
    gen = torch.Generator().manual_seed(seed)
    ps = [
        torch.randn(7, 9, generator=gen).to(half),
        torch.randn(33, generator=gen).to(half),
        torch.randn(5, 3, generator=gen),  # fp32: keeps its fp32 master
        _noncontiguous(6, 4, gen, half),
        torch.randn((), generator=gen).to(half),
    ]
    return [p.to(device).requires_grad_() for p in ps]


def set_grads(params, step):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype)


def run(opt, params, steps=4):
    for t in range(steps):
        set_grads(params, t)
        opt.step()
        opt.zero_grad()


def mapped(cls, params, mwb, quantize, **kw):
    """The MemOptimizer a Flash* call stands for."""
    hyper = {"stochastic_rounding": True, **FLASHOPTIM[cls], **kw}
    for k in ("quantize", "compress_state_dict", "master_weight_bits", "check_numerics", "fused"):
        hyper.pop(k)
    return MemOptimizer(
        params,
        rule=RULE[cls],
        master=MASTER_WEIGHT_BITS[mwb],
        moments="q8" if quantize else "fp32",
        seed=0,
        **hyper,
    )


# ------------------------------------------------------------------------------ constructor
@pytest.mark.parametrize("cls", list(FLASHOPTIM), ids=lambda c: c.__name__)
def test_signature_matches_flashoptim(cls):
    sig = inspect.signature(cls.__init__)
    positional = [
        (n, p.default)
        for n, p in sig.parameters.items()
        if p.kind is p.POSITIONAL_OR_KEYWORD and n not in ("self", "params")
    ]
    assert positional == list(FLASHOPTIM[cls].items())
    keyword_only = {n: p.default for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert keyword_only == {"stochastic_rounding": True, "seed": 0, "capturable": False}


@pytest.mark.parametrize("cls", list(FLASHOPTIM), ids=lambda c: c.__name__)
def test_defaults_map_to_ecc24_q8_sr(cls):
    p = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    opt = cls([p])
    assert isinstance(opt, FlashOptimizer)
    assert isinstance(opt, MemOptimizer)
    assert opt.rule == RULE[cls]
    g = opt.param_groups[0]
    assert (g["master"], g["moments"], g["stochastic_rounding"]) == ("ecc24", "q8", True)
    assert g["lr"] == 1e-3
    assert (opt.quantize, opt.master_weight_bits, opt.compress_state_dict, opt.fused) == (
        True,
        24,
        True,
        True,
    )
    assert opt.check_numerics is False
    assert opt.seed == 0
    assert opt.backend is None  # fused=True: the best registered backend
    assert cls([p], fused=False).backend == "torch"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(master_weight_bits=16), "master_weight_bits must be 24"),
        (dict(master_weight_bits=True), "master_weight_bits must be 24"),
        (dict(master_weight_bits=24.0), "master_weight_bits must be 24"),
        (dict(master_weight_bits="32"), "master_weight_bits must be 24"),
        (dict(quantize=1), "quantize must be True or False"),
        (dict(fused="yes"), "fused must be True or False"),
        (dict(compress_state_dict=None), "compress_state_dict must be True or False"),
        (dict(check_numerics=1), "check_numerics must be True or False"),
        (dict(lr=-1.0), "invalid learning rate"),
        (dict(betas=(1.0, 0.9)), "invalid beta1"),
        (dict(eps=-1e-8), "invalid eps"),
        (dict(weight_decay=-0.1), "invalid weight_decay"),
        (dict(stochastic_rounding=None), "stochastic_rounding"),
        (dict(seed=-1), "seed must be an int"),
    ],
)
def test_validation_errors(kwargs, match):
    p = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ConfigError, match=match):
        FlashAdamW([p], **kwargs)
    with pytest.raises(ValueError, match=match):  # ConfigError is a ValueError
        FlashAdamW([p], **kwargs)


def test_validation_errors_sgd_and_dtypes():
    p = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ConfigError, match="nesterov=True"):
        FlashSGD([p], nesterov=True)
    half = torch.zeros(4, dtype=torch.float16, requires_grad=True)
    with pytest.raises(ConfigError, match="cast them to bfloat16"):
        FlashAdamW([half])  # ECC splits fp32 into bf16 + code; fp16 has no ECC
    FlashAdamW([half], master_weight_bits=None)  # fp16 without a master is fine
    with pytest.raises(ConfigError, match=r"dtype torch\.int64"):
        FlashAdamW([torch.zeros(3, dtype=torch.int64)])


# ------------------------------------------------------------------- equal to MemOptimizer
@pytest.mark.parametrize("cls", list(FLASHOPTIM), ids=lambda c: c.__name__)
@pytest.mark.parametrize(("mwb", "quantize"), [(24, True), (32, False), (None, True)])
def test_equals_mapped_memoptimizer(cls, mwb, quantize, device):
    a, b = make_params(device), make_params(device)
    flash = cls(a, master_weight_bits=mwb, quantize=quantize, **HYPER[cls])
    core = mapped(cls, b, mwb, quantize, **HYPER[cls])
    run(flash, a)
    run(core, b)
    assert_same_state(flash, a, core, b)
    assert flash.state_bytes() == core.state_bytes()
    # bf16 parameters carry the mapped master code; the fp32 one keeps no code
    code = {24: torch.uint8, 32: torch.int16, None: None}[mwb]
    for p in a:
        got = flash.state[p].get("master_code")
        if p.dtype == torch.float32 or code is None:
            assert got is None
        else:
            assert got.dtype == code
            assert got.shape == p.shape
    assert a[3].stride() == (1, 6)  # the non-contiguous parameter kept its layout


@pytest.mark.parametrize("cls", list(FLASHOPTIM), ids=lambda c: c.__name__)
@pytest.mark.parametrize("mwb", [24, 32, None])
@pytest.mark.parametrize("quantize", [True, False])
def test_equals_torch_backend_reference_over_120_steps(cls, mwb, quantize, device):
    """Every class x master_weight_bits x quantize, with its momentum and weight decay, stays bit
    for bit equal to the mapped MemOptimizer on core's torch backend for 120 steps, while the
    Flash* class runs on whichever backend it picks (the cpu kernels on CPU, triton on CUDA)."""
    a, b = make_params(device), make_params(device)
    flash = cls(a, master_weight_bits=mwb, quantize=quantize, **HYPER[cls])
    core = mapped(cls, b, mwb, quantize, backend="torch", **HYPER[cls])
    run(flash, a, steps=120)
    run(core, b, steps=120)
    assert all(int(flash.state[p]["step"]) == 120 for p in a)
    assert_same_state(flash, a, core, b)  # parameters and raw states (codes, scales, steps)
    for i, (p, q) in enumerate(zip(a, b, strict=True)):
        assert same_bits(fp32_master(flash, p), fp32_master(core, q)), f"master {i} differs"
    assert flash.state_bytes() == core.state_bytes()


# what the 120-step test leaves at one value: stochastic rounding (on), SGD's momentum (on) and
# the parameters' dtype (bf16). One case per gap, each with another master and moment format,
# instead of the cross product (it would triple the suite's time on 2 cores).
_RN = dict(stochastic_rounding=False)
_F16 = torch.float16
GAPS = {
    # round to nearest: every class
    "FlashSGD-rn-24-q8": (FlashSGD, 24, True, torch.bfloat16, {**HYPER[FlashSGD], **_RN}),
    "FlashSGDW-rn-32-q8": (FlashSGDW, 32, True, torch.bfloat16, {**HYPER[FlashSGDW], **_RN}),
    "FlashAdam-rn-none-q8": (FlashAdam, None, True, torch.bfloat16, {**HYPER[FlashAdam], **_RN}),
    "FlashAdamW-rn-24-fp32": (FlashAdamW, 24, False, torch.bfloat16, {**HYPER[FlashAdamW], **_RN}),
    "FlashLion-rn-32-q8": (FlashLion, 32, True, torch.bfloat16, {**HYPER[FlashLion], **_RN}),
    # SGD without momentum (FlashOptim's default): no moment, only the master code
    "FlashSGD-m0-32": (FlashSGD, 32, True, torch.bfloat16, dict(lr=1e-2, weight_decay=0.1)),
    "FlashSGDW-m0-24": (
        FlashSGDW,
        24,
        True,
        torch.bfloat16,
        dict(lr=1e-2, weight_decay=0.1, decouple_lr=True),
    ),
    "FlashSGD-m0-none-rn": (FlashSGD, None, True, torch.bfloat16, dict(lr=1e-2, **_RN)),
    # fp16 parameters: only without a master (core has no fp16 ECC; the others are refused)
    "FlashSGD-fp16-q8": (FlashSGD, None, True, _F16, HYPER[FlashSGD]),
    "FlashSGDW-fp16-m0": (FlashSGDW, None, True, _F16, dict(lr=1e-2, weight_decay=0.1)),
    "FlashAdam-fp16-fp32": (FlashAdam, None, False, _F16, HYPER[FlashAdam]),
    "FlashAdamW-fp16-q8": (FlashAdamW, None, True, _F16, HYPER[FlashAdamW]),
    "FlashLion-fp16-rn-q8": (FlashLion, None, True, _F16, {**HYPER[FlashLion], **_RN}),
}


@pytest.mark.parametrize("case", list(GAPS))
def test_equals_torch_backend_reference_rounding_to_nearest_momentum_0_fp16(case, device):
    """Round to nearest, SGD/SGDW without momentum and fp16 parameters (beside an fp32 one) stay
    bit for bit equal to the mapped MemOptimizer on core's torch backend for 120 steps, as in
    the test above; fp16 parameters with an ECC master are refused."""
    cls, mwb, quantize, half, hyper = GAPS[case]
    a, b = make_params(device, half=half), make_params(device, half=half)
    flash = cls(a, master_weight_bits=mwb, quantize=quantize, **hyper)
    core = mapped(cls, b, mwb, quantize, backend="torch", **hyper)
    sr = hyper.get("stochastic_rounding", True)
    assert [g["stochastic_rounding"] for g in flash.param_groups] == [sr]
    run(flash, a, steps=120)
    run(core, b, steps=120)
    assert all(int(flash.state[p]["step"]) == 120 for p in a)
    assert_same_state(flash, a, core, b)
    for i, (p, q) in enumerate(zip(a, b, strict=True)):
        assert same_bits(fp32_master(flash, p), fp32_master(core, q)), f"master {i} differs"
    assert flash.state_bytes() == core.state_bytes()
    # the state holds what the configuration needs: no moment without momentum, no code for
    # fp16 (or fp32) parameters
    moments = {FlashAdam: 2, FlashAdamW: 2, FlashLion: 1}.get(
        cls, int(hyper.get("momentum", 0) > 0)
    )
    for p in a:
        codes = {k for k in flash.state[p] if k.startswith("master_code")}
        assert bool(codes) == (mwb is not None and p.dtype == torch.bfloat16), case
        names = {k for k in flash.state[p] if k.startswith(("exp_avg", "momentum_buffer"))}
        assert len({k.removesuffix("_scale") for k in names}) == moments, (case, names)
    assert a[0].dtype == half
    if half == torch.float16:
        for bits_ in (24, 32):
            with pytest.raises(ConfigError, match="cast them to bfloat16"):
                cls(make_params(device, half=half), master_weight_bits=bits_, **hyper)


# ----------------------------------------------------------------------- bytes per parameter
@pytest.mark.parametrize(
    ("cls", "kwargs", "dtype", "per_element"),
    [
        (FlashAdamW, dict(), torch.bfloat16, 1 + 2 * 1.03125),
        (FlashAdamW, dict(master_weight_bits=32), torch.bfloat16, 2 + 2 * 1.03125),
        (FlashAdamW, dict(master_weight_bits=None), torch.bfloat16, 2 * 1.03125),
        (FlashAdamW, dict(quantize=False), torch.bfloat16, 1 + 8),
        (FlashAdamW, dict(master_weight_bits=32, quantize=False), torch.bfloat16, 2 + 8),
        (FlashAdamW, dict(), torch.float32, 2 * 1.03125),  # fp32 params: no code
        (FlashAdam, dict(), torch.bfloat16, 1 + 2 * 1.03125),
        (FlashLion, dict(), torch.bfloat16, 1 + 1.03125),
        (FlashLion, dict(quantize=False, master_weight_bits=32), torch.bfloat16, 2 + 4),
        (FlashSGD, dict(), torch.bfloat16, 1),  # no momentum: only the code
        (FlashSGD, dict(momentum=0.9), torch.bfloat16, 1 + 1.03125),
        (FlashSGDW, dict(momentum=0.9, master_weight_bits=None), torch.bfloat16, 1.03125),
    ],
)
def test_state_bytes_per_parameter(cls, kwargs, dtype, per_element):
    n = 32 * 40  # whole q8 blocks: no padding
    p = torch.randn(n).to(dtype).requires_grad_()
    opt = cls([p], **kwargs)
    assert opt.state_bytes() == 0  # state appears with the first step
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state_bytes() == n * per_element


def test_mixed_dtypes_in_one_group_bytes():
    bf, fp = torch.randn(64).bfloat16().requires_grad_(), torch.randn(64).requires_grad_()
    opt = FlashAdamW([bf, fp])
    for p in (bf, fp):
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state_bytes() == 64 * (1 + 2.0625) + 64 * 2.0625
    assert bf.dtype == torch.bfloat16
    assert fp.dtype == torch.float32
    assert opt.state[bf]["master_code"].dtype == torch.uint8
    assert "master_code" not in opt.state[fp]


# ------------------------------------------------------------------------------- fused
class _CountingBackend(TorchBackend):
    """A stand-in kernel backend: the torch backend's bits, counting its calls."""

    name = "cpu"

    def __init__(self) -> None:
        self.calls = 0

    def step(self, work) -> None:
        self.calls += 1
        super().step(work)


def test_fused_uses_a_registered_kernel_backend(monkeypatch):
    fake = _CountingBackend()
    monkeypatch.delenv("MEMOPT_BACKEND", raising=False)

    def discover():
        return {
            "torch": backends._builtin(),
            "cpu": backends.BackendStatus("cpu", True, "test stand-in", "tests", fake),
        }

    monkeypatch.setattr(backends, "_discover", discover)
    backends._registry = None
    try:
        a, b = make_params("cpu"), make_params("cpu")
        fused, plain = FlashAdamW(a), FlashAdamW(b, fused=False)
        run(fused, a, steps=2)
        assert fake.calls > 0  # fused=True: the registered backend ran the groups
        calls = fake.calls
        run(plain, b, steps=2)
        assert fake.calls == calls  # fused=False: core's torch backend only
        assert_same_state(fused, a, plain, b)  # same bits either way
    finally:
        backends._registry = None


# --------------------------------------------------------------------- compress_state_dict
def _train_pair(device, steps=3, moments="q8", **kwargs):
    params = make_params(device)
    opt = FlashAdamW([{"params": params, "moments": moments}], **HYPER[FlashAdamW], **kwargs)
    run(opt, params, steps=steps)
    return opt, params


def _decay_norm(beta2: float, step: int) -> float:
    """``N = beta2**(step % P)``, ``P`` the largest count with ``beta2**P >= 2**-8``: the
    decay an 8-bit second moment is stored divided by (computed here, not by memopt-core)."""
    period = 1
    while beta2 ** (period + 1) >= 2.0**-8:
        period += 1
    return beta2 ** (step % period)


def _stored_v(opt, p):
    """``p``'s second moment ``v`` from the optimizer's live codes: decoded by the codec and
    multiplied by :func:`_decay_norm` (one rounding, from double), shaped like ``p``."""
    from memopt_core.formats import MOMENT_PRESETS, moment_codec
    from memopt_core.plan import state_key

    group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    codec = moment_codec(MOMENT_PRESETS[group["moments"]][1])
    st = opt.state[p]
    u = codec.decode({sfx: st[state_key("exp_avg_sq", sfx)] for sfx in codec.fields})
    u = u.reshape(-1)[: p.numel()].reshape(p.shape)
    norm = _decay_norm(group["betas"][1], int(st["step"].item()))
    return (u.double() * norm).float()


def test_compressed_state_dict_keeps_codes(device):
    opt, _ = _train_pair(device)
    st = opt.state_dict()["state"][0]
    assert st["exp_avg"].dtype == torch.float8_e4m3fn
    assert st["exp_avg_sq"].dtype == torch.uint8
    assert "exp_avg_scale" in st
    assert st["master_code"].dtype == torch.uint8


@pytest.mark.parametrize(
    ("moments", "beta2", "steps"),
    [
        ("q8", 0.999, 3),
        # 8-bit second moments are stored decay-normalized, u = v / beta2**(k % P): saved one
        # step before a period's end (P = 8 for 0.5, 52 for 0.9), resumed across it
        ("q8", 0.5, 7),
        ("fp8", 0.5, 7),
        ("q8", 0.9, 51),
        ("fp8", 0.9, 51),
        ("q8", 0.5, 8),  # saved at a period's end (N = 1)
    ],
)
def test_uncompressed_state_dict_resumes_bit_identically(device, moments, beta2, steps):
    hyper = dict(HYPER[FlashAdamW], betas=(0.9, beta2))
    params = make_params(device)
    opt = FlashAdamW([{"params": params, "moments": moments}], **hyper, compress_state_dict=False)
    run(opt, params, steps=steps)
    seen = []  # a state-dict post-hook sees the decoded moments state_dict() returns
    opt.register_state_dict_post_hook(lambda o, sd: seen.append(sd["state"][0]["exp_avg"].dtype))
    sd = opt.state_dict()
    assert seen == [torch.float32]
    assert sd["memopt"]["decay_norm_beta2"] == [beta2]
    assert sd["memopt"]["version"] == 2
    for i, p in enumerate(params):
        st = sd["state"][i]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq", "master_code", "param_shape"} - (
            {"master_code"} if p.dtype == torch.float32 else set()
        )
        assert st["param_shape"].tolist() == list(p.shape)
        assert st["exp_avg"].dtype == torch.float32
        assert st["exp_avg"].shape == p.shape
        assert st["exp_avg_sq"].shape == p.shape
        # the decoded second moment is Adam's v: the stored u times beta2**(k % P)
        assert same_bits(st["exp_avg_sq"], _stored_v(opt, p)), i
        for name in ("exp_avg", "exp_avg_sq"):  # no padded tail for torch.save to store
            assert st[name].untyped_storage().nbytes() == st[name].nbytes
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)

    # continue: the original, a copy loaded from the uncompressed dict, and (for reference)
    # a copy loaded from the compressed dict of the same state
    twin_params = [p.detach().clone().requires_grad_() for p in params]
    twin = FlashAdamW(
        [{"params": twin_params, "moments": moments}],
        **HYPER[FlashAdamW],
        compress_state_dict=False,
    )  # built with another beta2: the dict's is loaded
    twin.load_state_dict(loaded)
    assert twin.param_groups[0]["betas"] == (0.9, beta2)
    # decoding the encoded moments gives exactly the values that were saved
    for i, (p, q) in enumerate(zip(params, twin_params, strict=True)):
        assert same_bits(twin.state[q]["step"], opt.state[p]["step"])
        assert same_bits(_stored_v(twin, q), _stored_v(opt, p)), i
    other_params = [p.detach().clone().requires_grad_() for p in params]
    other = FlashAdamW([{"params": other_params, "moments": moments}], **hyper)
    opt.compress_state_dict = True
    other.load_state_dict(opt.state_dict())
    for o, ps in ((opt, params), (twin, twin_params), (other, other_params)):
        for t in range(steps, steps + 3):
            set_grads(ps, t)
            o.step()
    assert_same_state(opt, params, twin, twin_params)
    assert_same_state(opt, params, other, other_params)
    # the uncompressed dict is a snapshot: the steps since changed none of its entries (its
    # step counts and master codes were live views beside decoded copies, so a dict held
    # across steps mixed two steps' states: adversarial testing, 2026-12-04)
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(v.cpu(), loaded["state"][i][k].cpu()), (i, k)


@pytest.mark.parametrize("moments", ["q8", "fp8"])
@pytest.mark.parametrize("compress", [True, False], ids=["compressed", "decoded"])
def test_a_version_1_state_dict_holds_v_and_loads_as_v(moments, compress):
    """A state dict of memopt before decay-normalized second moments (version 1, no
    ``decay_norm_beta2``) holds ``v`` itself, as codes or decoded: it loads as ``v`` (the
    decoded dict gives it back exactly, ``decay_norm`` is 1), and the next step normalizes."""
    from memopt_core import conversions
    from memopt_core.formats import MOMENT_PRESETS, moment_codec
    from memopt_core.plan import padding_unit, round_up, state_key

    hyper = dict(HYPER[FlashAdamW], betas=(0.9, 0.5))
    params = make_params("cpu")
    opt = FlashAdamW([{"params": params, "moments": moments}], **hyper)
    run(opt, params, steps=5)  # N = 0.5**5
    codec = moment_codec(MOMENT_PRESETS[moments][1])
    fields = [state_key("exp_avg_sq", sfx) for sfx in codec.fields]
    sd = copy.deepcopy(opt.state_dict())
    raw = []  # v on the raw (not normalized) grid: what a version-1 dict held
    for i, p in enumerate(params):
        v = _stored_v(opt, p)
        spec = opt._spec_of(opt.param_groups[0], p)
        flat = torch.zeros(round_up(p.numel(), padding_unit(spec)))
        flat[: p.numel()] = v.reshape(-1)
        codes = conversions.encode_moment(codec, flat)
        raw.append(conversions.decode_moment(codec, codes)[: p.numel()].reshape(p.shape))
        entry = sd["state"][i]
        for sfx, k in zip(codec.fields, fields, strict=True):
            del entry[k]
            if compress:
                entry[k] = codes[sfx]
        if not compress:
            entry["exp_avg_sq"] = raw[-1].clone()
            entry["exp_avg"] = conversions.decode_moment(
                spec.first,
                {sfx: entry.pop(state_key("exp_avg", sfx)) for sfx in spec.first.fields},
            )[: p.numel()].reshape(p.shape)
    for meta in [sd["memopt"]] + [g["memopt"] for g in sd["param_groups"]]:
        del meta["decay_norm_beta2"]
        meta.update(version=1, compressed=compress)
    twin_params = [p.detach().clone().requires_grad_() for p in params]
    twin = FlashAdamW(
        [{"params": twin_params, "moments": moments}], **hyper, compress_state_dict=compress
    )
    twin.load_state_dict(sd)
    assert twin.decay_norm(0, 5) == 1.0
    # state_dict() normalizes them first (what the next step would do), so that its dict is
    # this version's whatever entry it loses; its decoded v is a few roundings from raw
    twin.compress_state_dict = False
    out = twin.state_dict()
    assert out["memopt"]["decay_norm_beta2"] == [0.5]
    assert twin.decay_norm(0, 5) == 0.5**5
    for i in range(len(twin_params)):
        a, b = raw[i].double(), out["state"][i]["exp_avg_sq"].double()
        tol = 0.6 if moments == "fp8" else 0.3
        assert ((a - b).abs() <= tol * a.abs() + 2.0**-10 * a.abs().max()).all(), i
    # the next step normalizes with the group's beta2 and goes on as the original does
    for o, ps in ((opt, params), (twin, twin_params)):
        set_grads(ps, 5)
        o.step()
    assert twin.decay_norm(0, 6) == opt.decay_norm(0, 6) == 0.5**6
    assert twin.state_dict()["memopt"]["decay_norm_beta2"] == [0.5]
    for p, q in zip(params, twin_params, strict=True):
        a, b = _stored_v(opt, p).double(), _stored_v(twin, q).double()
        # a few roundings apart (raw, normalized, then stochastic in the step): within a few
        # grid spacings of the format (q8: 2**-4 on sqrt(v); fp8's e5m2: 2**-2 on v), far from
        # the factor N = 2**-5 a v taken for u would be off by
        tol = 0.6 if moments == "fp8" else 0.3
        assert ((a - b).abs() <= tol * a.abs() + 2.0**-10 * a.abs().max()).all()


def _train_bf16(model, opt, device, steps, start):
    """``steps`` steps of a bfloat16 model with 12 inputs on a squared-output loss, batch ``t``
    from seed ``t`` (from ``start``)."""
    for t in range(start, start + steps):
        gen = torch.Generator().manual_seed(t)
        x = torch.randn(4, 12, generator=gen).to(device=device, dtype=torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_torchs_state_dict_helpers_carry_the_seed_and_compressed_flag(device):
    """torch's get_optimizer_state_dict / set_optimizer_state_dict keep only 'state' and
    'param_groups': the memopt entry (rule, seed, version, compressed) travels in every saved
    group, so an uncompressed dict resumes bit for bit into an optimizer built with another
    seed (before: the load kept that seed, and the stochastic rounding took other bits)."""
    pytest.importorskip("torch.distributed")
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def build(seed, init=0):
        torch.manual_seed(init)
        model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Linear(24, 5))
        model = model.to(device=device, dtype=torch.bfloat16)
        hyper = dict(HYPER[FlashAdamW], compress_state_dict=False, seed=seed)
        return model, FlashAdamW(model.parameters(), **hyper)

    def train(model, opt, steps, start=0):
        _train_bf16(model, opt, device, steps, start)

    straight, sopt = build(3)
    train(straight, sopt, 6)
    first, fopt = build(3)
    train(first, fopt, 3)
    osd = copy.deepcopy(get_optimizer_state_dict(first, fopt))
    resumed, ropt = build(11, init=1)
    resumed.load_state_dict(first.state_dict())
    set_optimizer_state_dict(resumed, ropt, optim_state_dict=osd)
    train(resumed, ropt, 3, start=3)
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert same_bits(p, q)
    assert ropt.seed == 3
    assert all("memopt" not in g for g in ropt.param_groups)
    assert "memopt" not in osd
    meta = {
        "rule": "adamw",
        "seed": 3,
        "version": 2,
        "decay_norm_beta2": [0.999],
        "compressed": False,
    }
    assert [g["memopt"] for g in osd["param_groups"]] == [meta]
    assert osd["state"]["0.weight"]["exp_avg"].dtype == torch.float32  # decoded


def test_a_decoded_dict_into_a_core_optimizer_says_what_reads_it():
    """A compress_state_dict=False dict holds decoded moments, which only the memopt_ecc
    classes encode on load: a MemOptimizer (ApexW too) named each missing code field."""
    p = torch.randn(8, 40).bfloat16().requires_grad_()
    opt = FlashAdamW([p], compress_state_dict=False)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    core = MemOptimizer([p], rule="adamw", master="ecc24", moments="q8")
    with pytest.raises(StateDictError, match=r"decoded moments .* into that memopt_ecc class"):
        core.load_state_dict(sd)
    assert not core.state
    FlashAdamW([p]).load_state_dict(sd)  # the compressed class reads it too


def test_uncompressed_moment_that_does_not_fit_is_named():
    p = torch.randn(8, 40).bfloat16().requires_grad_()
    opt = FlashAdamW([p], compress_state_dict=False)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    q = torch.randn(40, 8).bfloat16().requires_grad_()  # a transposed model
    # the entry's param_shape names the mismatch first, before any moment is encoded
    with pytest.raises(
        StateDictError,
        match=r"state of parameter index 0 \(shape \(40, 8\).*saved for a parameter of shape "
        r"\(8, 40\); .*belongs to another parameter",
    ):
        FlashAdamW([q], compress_state_dict=False).load_state_dict(sd)
    del sd["state"][0]["param_shape"]  # a state dict of an older version: the moment's shape
    with pytest.raises(
        StateDictError,
        match=r"state 'exp_avg' of parameter index 0 is torch.float32 of shape \(8, 40\); a "
        r"decoded moment .* must be torch.float32 of the parameter's shape \(40, 8\)",
    ):
        FlashAdamW([q], compress_state_dict=False).load_state_dict(sd)
    sd["state"][0]["exp_avg_sq"] = sd["state"][0]["exp_avg_sq"].bfloat16()
    with pytest.raises(
        StateDictError, match=r"state 'exp_avg_sq' of parameter index 0 is torch.bfloat16 of"
    ):
        FlashAdamW([p]).load_state_dict(sd)
    # codes missing their scales are still reported as missing fields
    opt.compress_state_dict = True
    sd = opt.state_dict()
    del sd["state"][0]["exp_avg_scale"]
    with pytest.raises(StateDictError, match=r"lacks \['exp_avg_scale'\]"):
        FlashAdamW([p]).load_state_dict(sd)


@pytest.mark.parametrize("quantize", [True, False])
def test_a_negative_decoded_second_moment_is_refused(quantize):
    """q8 encoded a negative ``v`` as its NaN code, and the next step made NaN weights."""
    p = torch.randn(8, 40).bfloat16().requires_grad_()
    opt = FlashAdamW([p], compress_state_dict=False, quantize=quantize)
    p.grad = torch.randn_like(p)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg_sq"][2, 3] = -1e-20
    with pytest.raises(StateDictError, match=r"'exp_avg_sq' of parameter index 0 .*negative"):
        opt.load_state_dict(sd)
    for k, v in before.items():
        assert torch.equal(opt.state[p][k], v), k
    sd["state"][0]["exp_avg_sq"][2, 3] = -0.0  # what sqrt keeps: a second moment
    opt.load_state_dict(sd)


@pytest.mark.parametrize("value", [torch.tensor([True, False]), torch.tensor(True), "yes", None])
def test_a_saved_stochastic_rounding_that_is_no_bool_is_named(value):
    """``bool()`` of a saved tensor of two values was a bare RuntimeError in the ECC loader."""
    p = torch.randn(8, 40).bfloat16().requires_grad_()
    opt = FlashAdamW([p])
    p.grad = torch.randn_like(p)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["stochastic_rounding"] = value
    with pytest.raises(StateDictError, match=r"stochastic_rounding .* must be True or False"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("saved", ["bf16", "fp32"])
def test_a_state_saved_for_a_parameter_of_the_other_dtype_says_so(saved):
    """A bf16 model's state (cast_model) loaded into an fp32 one, or the reverse: the message
    listed entries against a format ``master='fp32'`` the user never chose."""
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(6, 5))
    b = torch.nn.Parameter(a.detach().clone())
    (a if saved == "bf16" else b).data = (a if saved == "bf16" else b).data.bfloat16()
    opt = FlashAdamW([a])
    a.grad = torch.randn(6, 5).to(a.dtype)
    opt.step()
    match = (
        r"holds a 'master_code' \(a bf16/fp16 parameter's ECC code\), but this parameter is "
        r"torch.float32 with master 'fp32'.*cast_model"
        if saved == "bf16"
        else r"lacks 'master_code', the ecc24 code of this torch.bfloat16 parameter: it was saved "
        r"for a parameter that keeps none.*set_fp32_model_state_dict"
    )
    with pytest.raises(StateDictError, match=match):
        FlashAdamW([b]).load_state_dict(opt.state_dict())


@pytest.mark.parametrize("compress", [True, False], ids=["compressed", "decoded"])
@pytest.mark.parametrize(
    ("dtype", "bits"), [(torch.float32, 24), (torch.bfloat16, None)], ids=["fp32", "bf16-none"]
)
def test_state_of_a_reordered_parameter_is_refused(compress, dtype, bits):
    """An MLP's up (64, 16) and down (16, 64) weights: fp32 parameters (their own master), or
    bf16 ones without a master (``master_weight_bits=None``), keep no code shaped like them,
    and their q8 moments have the same sizes. The state dict's ``param_shape`` tells them
    apart: loaded in the saved order they resume bit for bit (either form of the dict), in the
    other order they are refused with nothing changed."""
    gen = torch.Generator().manual_seed(0)
    up, down = (
        torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in ((64, 16), (16, 64))
    )
    kw = dict(HYPER[FlashAdamW], master_weight_bits=bits, compress_state_dict=compress)
    opt = FlashAdamW([up, down], **kw)
    run(opt, [up, down], steps=2)
    sd = opt.state_dict()
    assert [sd["state"][i]["param_shape"].tolist() for i in (0, 1)] == [[64, 16], [16, 64]]
    assert all("param_shape" not in s for s in opt.state.values())

    clones = [p.detach().clone().requires_grad_() for p in (up, down)]
    twin = FlashAdamW(clones, **kw)
    twin.load_state_dict(copy.deepcopy(sd))
    for o, ps in ((opt, [up, down]), (twin, clones)):
        for t in range(2, 4):
            set_grads(ps, t)
            o.step()
    assert_same_state(opt, [up, down], twin, clones)

    swapped = [p.detach().clone().requires_grad_() for p in (down, up)]
    other = FlashAdamW(swapped, **kw)
    run(other, swapped, steps=1)
    before = [{k: v.clone() for k, v in other.state[p].items()} for p in swapped]
    with pytest.raises(
        StateDictError,
        match=r"state of parameter index 0 \(shape \(16, 64\).* saved for a parameter of shape "
        r"\(64, 16\); .*belongs to another parameter",
    ):
        other.load_state_dict(sd)
    for p, b in zip(swapped, before, strict=True):
        assert other.state[p].keys() == b.keys()
        assert all(torch.equal(other.state[p][k], v) for k, v in b.items())


def test_uncompressed_without_quantize_is_the_same_dict():
    params = make_params("cpu")
    opt = FlashAdamW(params, quantize=False, compress_state_dict=False)
    run(opt, params, steps=2)
    st = opt.state_dict()["state"][0]
    assert st["exp_avg"].dtype == torch.float32
    assert "exp_avg_scale" not in st


# ------------------------------------------------------------------------ param groups
def test_param_groups_take_flashoptim_keys():
    a = torch.randn(40).bfloat16().requires_grad_()
    b = torch.randn(40).bfloat16().requires_grad_()
    opt = FlashAdamW(
        [{"params": [a], "master_weight_bits": 32, "quantize": False}, {"params": [b]}]
    )
    g0, g1 = opt.param_groups
    assert (g0["master"], g0["moments"]) == ("ecc32", "fp32")
    assert (g1["master"], g1["moments"]) == ("ecc24", "q8")
    assert "master_weight_bits" not in g0
    assert "quantize" not in g0
    for p in (a, b):
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[a]["master_code"].dtype == torch.int16
    assert opt.state[b]["master_code"].dtype == torch.uint8
    # the caller's dict is the group, as in torch: edits through it take effect
    c = torch.randn(40).bfloat16().requires_grad_()
    mine = {"params": [c], "lr": 1e-3, "master_weight_bits": 32}
    opt.add_param_group(mine)
    assert opt.param_groups[2] is mine
    assert mine["master"] == "ecc32"
    assert "master_weight_bits" not in mine
    with pytest.raises(ConfigError, match="both master_weight_bits and master"):
        opt.add_param_group(
            {
                "params": [torch.zeros(3, requires_grad=True)],
                "master_weight_bits": 32,
                "master": "ecc24",
            }
        )
    with pytest.raises(ConfigError, match="master_weight_bits must be"):
        opt.add_param_group(
            {"params": [torch.zeros(3, requires_grad=True)], "master_weight_bits": 8}
        )


def test_flashoptim_master_bytewidth_is_refused_not_ignored():
    """FlashOptim records the master width per group as ``master_bytewidth`` (3 or 4); memopt
    reads ``master_weight_bits`` only, so the key would change nothing: refused, when the group
    is added or when written into it later."""
    a = torch.randn(40).bfloat16().requires_grad_()
    with pytest.raises(ConfigError, match=r"param group 0 sets master_bytewidth=4.*master_weight"):
        FlashAdamW([{"params": [a], "master_bytewidth": 4}])
    opt = FlashAdamW([a])
    a.grad = torch.ones_like(a)
    opt.param_groups[0]["master_bytewidth"] = 4
    with pytest.raises(ConfigError, match="master_bytewidth"):
        opt.step()
    assert a not in opt.state


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("quantize", False, r"param group 0 sets quantize=False, but its moments is 'q8'"),
        ("master_weight_bits", 32, r"sets master_weight_bits=32, but its master is 'ecc24'"),
        ("master_weight_bits", 16, r"master_weight_bits must be 24"),
        ("compress_state_dict", False, r"compress_state_dict is a constructor argument"),
        ("fused", False, r"sets fused=False, but fused is a constructor argument .*fused=True"),
        ("check_numerics", True, r"check_numerics is a constructor argument"),
    ],
)
def test_flashoptim_keys_written_into_param_groups_later_are_refused(key, value, match):
    # translated (or optimizer-wide) at construction: a later change would be ignored silently
    p = torch.randn(64).bfloat16().requires_grad_()
    opt = FlashAdamW([p])
    p.grad = torch.randn_like(p)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0][key] = value
    with pytest.raises(ConfigError, match=match):
        opt.step()
    with pytest.raises(ConfigError, match=match):
        opt.step_parameters([p])
    assert torch.equal(p.detach(), before)
    assert int(opt.state[p]["step"]) == 1
    opt.param_groups[0][key] = {"quantize": True, "master_weight_bits": 24}.get(
        key, getattr(opt, key)
    )  # the value it runs with is accepted
    opt.step()
    assert int(opt.state[p]["step"]) == 2
    with pytest.raises(ConfigError, match="constructor argument"):
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)], "seed": 1})


# ------------------------------------------------------------------ schedulers, closures
def test_lr_scheduler_and_closure():
    params = make_params("cpu")
    opt = FlashAdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    losses = []

    def closure():
        opt.zero_grad()
        loss = sum((p.float() ** 2).sum() for p in params)
        loss.backward()
        losses.append(loss.item())
        return loss

    for _ in range(3):
        assert opt.step(closure) is not None
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    assert losses[2] < losses[0]
    assert all(int(opt.state[p]["step"]) == 3 for p in params)


# ------------------------------------------------------------------------------- copies
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_the_flash_configuration(how):
    params = make_params("cpu")
    opt = FlashLion(params, master_weight_bits=32, quantize=False, compress_state_dict=False)
    run(opt, params, steps=2)
    if how == "deepcopy":
        twin_params, twin = copy.deepcopy((params, opt))
    else:
        twin_params, twin = pickle.loads(pickle.dumps((params, opt)))
    assert isinstance(twin, FlashLion)
    assert (twin.quantize, twin.master_weight_bits, twin.compress_state_dict, twin.fused) == (
        False,
        32,
        False,
        True,
    )
    for o, ps in ((opt, params), (twin, twin_params)):
        for t in range(2, 4):
            set_grads(ps, t)
            o.step()
    assert_same_state(opt, params, twin, twin_params)
    assert same_bits(params[0], twin_params[0])


# --------------------------------------------------------------------------- step hooks
def test_step_hooks_fire_once_per_step_call():
    """torch wraps ``step`` of each class it is built as; FlashAdamW, and a subclass whose
    ``step`` calls ``super().step()``, still fire each hook once per call."""

    class Logged(FlashAdamW):
        def step(self, closure=None):
            self.calls = getattr(self, "calls", 0) + 1
            return super().step(closure)

    FlashAdamW([torch.zeros(2, requires_grad=True)])  # FlashAdamW.step is wrapped first
    for cls in (FlashAdamW, Logged, MemOptimizer):
        params = make_params("cpu")
        opt = cls(params, lr=1e-2)
        counts = {"pre": 0, "post": 0}

        def bump(key, counts=counts):
            return lambda *args: counts.__setitem__(key, counts[key] + 1)

        pre = opt.register_step_pre_hook(bump("pre"))
        post = opt.register_step_post_hook(bump("post"))
        for t in range(3):
            set_grads(params, t)
            opt.step()
        pre.remove()
        post.remove()
        assert counts == {"pre": 3, "post": 3}, cls.__name__
        assert all(int(opt.state[p]["step"]) == 3 for p in params)


# ------------------------------------------------------------- FlashOptim's API (audit round 3)
def test_flashoptim_methods_and_error_base():
    """recompute_param_stats() (FlashOptim's check_numerics docs call it) and step_param(p,
    group) raised AttributeError; NumericsError was not a RuntimeError as FlashOptim's is."""
    from memopt_ecc import NumericsError

    assert issubclass(NumericsError, RuntimeError)
    a, b = (torch.nn.Parameter(torch.randn(40).bfloat16()) for _ in range(2))
    twin_a = torch.nn.Parameter(a.detach().clone())
    opt = FlashAdamW([a, b], lr=1e-2)
    ref = FlashAdamW([twin_a], lr=1e-2)
    a.grad = twin_a.grad = torch.randn(40).bfloat16()
    b.grad = torch.randn(40).bfloat16()
    opt.recompute_param_stats()
    opt.step_param(a, opt.param_groups[0])
    ref.step()
    assert same_bits(a, twin_a)
    assert opt.state[a]["step"].item() == 1
    assert b not in opt.state or opt.state[b]["step"].item() == 0  # only a stepped
    other = FlashAdamW([torch.nn.Parameter(torch.zeros(2).bfloat16())])
    with pytest.raises(ConfigError, match="not in that group"):
        opt.step_param(a, other.param_groups[0])


def test_llmfoundry_entry_points_name_the_classes():
    from importlib.metadata import entry_points

    import memopt_ecc

    found = {e.name: e.load() for e in entry_points(group="llmfoundry_optimizers")}
    assert found["flash_adam_w"] is memopt_ecc.FlashAdamW
    assert found["flash_adam"] is memopt_ecc.FlashAdam
    assert found["flash_lion"] is memopt_ecc.FlashLion
    assert found["flash_sgd"] is memopt_ecc.FlashSGD
    assert found["flash_sgd_w"] is memopt_ecc.FlashSGDW


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("bits_", [24, 32])
def test_a_weight_zeroed_in_place_steps_from_zero(backend, bits_, monkeypatch):
    """A weight set in place between steps keeps its ECC code. Beside a zero, a code that
    carries decoded to NaN (KERNEL_API 5): nn.init.zeros_ on a trained bias put NaN into about
    half of it at the next step. Now the master of such an element is that zero, and of the
    others within 2**-133 of it (a code that does not carry, below the zero)."""
    if backend == "cpu":
        pytest.importorskip("memopt_kernels_cpu")
    monkeypatch.setenv("MEMOPT_BACKEND", backend)
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 64).to(torch.bfloat16)
    opt = FlashAdamW(lin.parameters(), lr=1e-2, master_weight_bits=bits_)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    for _ in range(3):
        lin(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    codes = opt.state[lin.bias]["master_code"].to(torch.int64)
    assert ((codes & (0x8000 if bits_ == 32 else 0x80)) != 0).any()  # the case is present
    torch.nn.init.zeros_(lin.bias)
    master = get_fp32_model_state_dict(lin, opt)["bias"]
    assert (master.abs() <= 2.0**-133).all()
    lin(x).float().square().mean().backward()
    opt.step()
    assert lin.bias.isfinite().all()
    assert lin.weight.isfinite().all()
    assert (lin.bias.float().abs() <= 1.1e-2).all()  # one Adam step of lr 1e-2 from zero


@pytest.mark.parametrize(
    ("key", "value"),
    [("fused", False), ("check_numerics", True), ("master_weight_bits", 32), ("quantize", False)],
)
def test_a_saved_group_with_other_flash_settings_is_refused_at_load(key, value):
    """Every step refuses a group whose FlashOptim keys disagree with the optimizer: a load took
    such a group, and every later step raised until another load (audit round 4)."""
    p = torch.nn.Parameter(torch.randn(40).bfloat16())
    opt = FlashAdamW([p], lr=1e-2)
    p.grad = torch.randn(40).bfloat16()
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0][key] = value
    before = [t.clone() for t in opt.state[p].values()]
    with pytest.raises(StateDictError, match=f"param group 0 of the state dict sets {key}="):
        opt.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(before, opt.state[p].values(), strict=True))
    assert key not in opt.param_groups[0] or opt.param_groups[0][key] != value
    opt.step()  # still steps


def test_master_weight_bits_of_float32_parameters_do_not_matter_to_load():
    """float32 parameters keep an fp32 master under any master_weight_bits, so their states are
    the same; a state dict saved with 24 was refused by an optimizer built with 32, naming ECC
    states that do not exist (adversarial testing, 2026-12-04). A group holding a bf16
    parameter still refuses another master."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(40)), torch.nn.Parameter(torch.randn(8, 5))]

    def grads(ps, t):
        g = torch.Generator().manual_seed(t)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)

    opt = FlashAdamW(params, lr=1e-2, master_weight_bits=24)
    for t in range(2):
        grads(params, t)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    for bits in (32, None):
        twin_params = [p.detach().clone().requires_grad_() for p in params]
        twin = FlashAdamW(twin_params, lr=1e-2, master_weight_bits=bits)
        twin.load_state_dict(sd)
        assert twin.param_groups[0]["master"] == ("ecc32" if bits else "none")
        for t in range(2, 4):
            grads(twin_params, t)
            twin.step()
        ref_params = [p.detach().clone().requires_grad_() for p in params]
        ref = FlashAdamW(ref_params, lr=1e-2, master_weight_bits=24)
        ref.load_state_dict(sd)
        for t in range(2, 4):
            grads(ref_params, t)
            ref.step()
        assert all(same_bits(p, q) for p, q in zip(ref_params, twin_params, strict=True))

    mixed = [torch.nn.Parameter(torch.randn(40)), torch.nn.Parameter(torch.randn(40).bfloat16())]
    a = FlashAdamW(mixed, lr=1e-2, master_weight_bits=24)
    grads(mixed, 0)
    a.step()
    # the way over names what keeps the master's low bits (a torch-layout conversion drops them)
    hint = r"holds master='ecc24' states; this optimizer uses .* set_fp32_model_state_dict after"
    with pytest.raises(StateDictError, match=hint):
        FlashAdamW(mixed, lr=1e-2, master_weight_bits=32).load_state_dict(a.state_dict())


@pytest.mark.parametrize("marker", ["group", "state"])
def test_a_flashoptim_state_dict_is_refused_with_the_way_over(marker):
    """FlashOptim 0.1.4's layout (``error_bits`` beside each parameter's moments,
    ``master_bytewidth`` in each group): refused with the fp32 weights route, not with advice
    to convert it as a torch optimizer's (which refuses it too)."""
    p = torch.randn(64).bfloat16().requires_grad_()
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "params": [0]}
    entry = {"step": torch.tensor(5), "exp_avg": torch.randn(64), "exp_avg_sq": torch.rand(64)}
    if marker == "group":
        group["master_bytewidth"] = 3
    else:
        entry["error_bits"] = torch.zeros(64, dtype=torch.int8).bfloat16()
    opt = FlashAdamW([p])
    with pytest.raises(StateDictError, match=r"saved by FlashOptim.*set_fp32_model_state_dict"):
        opt.load_state_dict({"state": {0: entry}, "param_groups": [group]})
    assert p not in opt.state


@pytest.mark.parametrize("how", ["in place", "assigned"])
def test_an_edited_step_count_equals_the_edit_of_a_decoded_state_dict(how, device):
    """``state[p]["step"].zero_()`` (torch users' restart of the bias corrections) or a new
    count put in the state, on q8 moments (stored ``u = v / beta2**(step % P)``): the next
    steps give the bits of the documented way around the normalization, the same edit made
    in a decoded (``compress_state_dict=False``) dict and loaded, and the same edit in a
    compressed dict (whose ``decay_norm_step`` records the count its codes are stored for).
    Before, ``u`` was read against the new count: ``v`` 1.8x (0.994**-100) here, silently."""

    def build(compress):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Linear(40, 5))
        model = model.to(device=device, dtype=torch.bfloat16)
        opt = FlashAdamW(
            model.parameters(), lr=1e-3, betas=(0.9, 0.994), compress_state_dict=compress
        )
        return model, opt

    runs = []
    for route in ("live", "decoded dict", "compressed dict"):
        model, opt = build(route == "compressed dict")
        _train_bf16(model, opt, device, 100, 0)
        if route != "live":
            sd = opt.state_dict()
            for st in sd["state"].values():
                assert ("decay_norm_step" in st) == (route == "compressed dict")
                st["step"] = torch.tensor(3.0)
            opt.load_state_dict(sd)
        else:
            for p in model.parameters():
                if how == "in place":
                    opt.state[p]["step"].fill_(3)
                else:
                    opt.state[p]["step"] = torch.tensor(3.0)
        _train_bf16(model, opt, device, 20, 100)
        runs.append((list(model.parameters()), opt))
    (pa, oa), *others = runs
    assert [int(oa.state[p]["step"]) for p in pa] == [23] * 4
    for pb, ob in others:
        assert_same_state(oa, pa, ob, pb)
