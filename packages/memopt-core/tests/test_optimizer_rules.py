"""MemOptimizer's numbers: bit-exact against a hand-written reference loop for every rule x format,
and within a few ulps of torch.optim for fp32 states.

The hand-written loop works on one tensor at a time with the reference rule and the codecs alone
(no plan, arena or backend): pad the tensor to the format's block, decode master and moments,
apply the rule, encode with stochastic-rounding words ``uniform_bits(seed, tensor id, element
index, step, stream)``. The optimizer groups tensors into one arena and runs the rule once over it,
so equality with ``torch.equal`` checks the layout, padding, rounding words and step bookkeeping.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memopt_core import MemOptimizer, StateSpec
from memopt_core import reference as R
from memopt_core.rng import STREAM_FIRST, STREAM_MASTER, STREAM_SECOND, uniform_bits

SHAPES = [(0,), (1,), (31,), (33,), (25, 40), ()]
STEPS = 3
SEED = 1234
# (rule, hyperparameters): every rule, with the options that change its arithmetic.
RULE_CASES = {
    "sgd": dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd_plain": dict(lr=0.05, weight_decay=0.01, maximize=True),
    "sgdw": dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1, decouple_lr=True),
    "adam": dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.01),
    "adamw": dict(lr=1e-2, weight_decay=0.1, maximize=True, eps=1e-6),
    "lion": dict(lr=1e-3, weight_decay=0.1, decouple_lr=True),
}
# (master, parameter dtype)
MASTERS = [
    ("fp32", torch.float32),
    ("none", torch.bfloat16),
    ("ecc24", torch.bfloat16),
    ("ecc32", torch.bfloat16),
]
MOMENTS = ["fp32", "bf16", "fp8", "q8"]


def _round_up(n: int, b: int) -> int:
    return -(-n // b) * b


def _make_inputs(dtype: torch.dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params = [(torch.randn(s, generator=gen) * 0.5).to(dtype) for s in SHAPES]
    grads = []
    for t in range(STEPS):
        row = []
        for i, s in enumerate(SHAPES):
            if t == 1 and i == 3:  # one tensor skips a step: step counts diverge
                row.append(None)
                continue
            g = torch.randn(s, generator=gen) * (1e-3 if t % 2 else 1.0)
            row.append(g.to(dtype) if i % 2 else g)  # param-dtype and fp32 gradients mixed
        grads.append(row)
    grads = [[None if g is None else g.to(device) for g in row] for row in grads]
    return [p.to(device) for p in params], grads


def _pad(x, padded):
    flat = x.reshape(-1)
    return torch.cat([flat, flat.new_zeros(padded - flat.numel())])


def _scalars(rule: str, hp: dict, step: int, normalized: bool = False):
    lr, wd = hp["lr"], hp.get("weight_decay", 0.0)
    initial = lr if hp.get("decouple_lr") else None
    if rule in ("adam", "adamw"):
        return R.adam_scalars(
            lr=lr,
            betas=hp.get("betas", (0.9, 0.999)),
            eps=hp.get("eps", 1e-8),
            weight_decay=wd,
            step=step,
            decoupled=rule == "adamw",
            maximize=hp.get("maximize", False),
            initial_lr=initial,
            normalized=normalized,
        )
    if rule == "lion":
        return R.lion_scalars(
            lr=lr,
            betas=hp.get("betas", (0.9, 0.99)),
            weight_decay=wd,
            maximize=hp.get("maximize", False),
            initial_lr=initial,
        )
    return R.sgd_scalars(
        lr=lr,
        momentum=hp.get("momentum", 0.0),
        dampening=hp.get("dampening", 0.0),
        nesterov=hp.get("nesterov", False),
        weight_decay=wd,
        decoupled=rule == "sgdw",
        maximize=hp.get("maximize", False),
        initial_lr=initial,
    )


def reference_run(rule, hp, spec: StateSpec, params, grads, seed):
    """The hand-written loop: per tensor, per step. Returns [(param, {state key: tensor})]."""
    names = {
        "adam": ["exp_avg", "exp_avg_sq"],
        "adamw": ["exp_avg", "exp_avg_sq"],
        "lion": ["exp_avg"],
    }.get(rule, ["momentum_buffer"] if hp.get("momentum") else [])
    out = []
    for tid, p0 in enumerate(params):
        dev = p0.device
        mc = spec.master_for(p0.dtype)
        n = p0.numel()
        padded = _round_up(n, spec.block_size)
        p = _pad(p0, padded)
        code = mc.encode(p.float())[1]
        codecs = {k: (spec.second if k == "exp_avg_sq" else spec.first) for k in names}
        fields = {k: c.allocate(padded, dev) for k, c in codecs.items()}
        step = 0
        for row in grads:
            g = row[tid]
            if g is None:
                continue
            step += 1
            # the 8-bit presets store Adam's second moment divided by its decay
            s = _scalars(rule, hp, step, normalized=spec.decay_normalized)
            x = mc.decode(p, code)
            g32 = _pad(g.float(), padded)
            vals = {k: c.decode(fields[k]) for k, c in codecs.items()}
            if rule in ("adam", "adamw"):
                x, vals["exp_avg"], vals["exp_avg_sq"] = R.adam(
                    x, g32, vals["exp_avg"], vals["exp_avg_sq"], s
                )
            elif rule == "lion":
                x, vals["exp_avg"] = R.lion(x, g32, vals["exp_avg"], s)
            else:
                buf = vals.get("momentum_buffer")
                x, buf = R.sgd(x, g32, buf, s, first_step=step == 1)
                if buf is not None:
                    vals["momentum_buffer"] = buf
            idx = torch.arange(padded, dtype=torch.int64, device=dev)
            words = {
                stream: uniform_bits(seed, tid, idx, step, stream)
                if spec.stochastic_rounding
                else None
                for stream in (STREAM_MASTER, STREAM_FIRST, STREAM_SECOND)
            }
            p, code = mc.encode(x, rand=words[STREAM_MASTER])
            for k, c in codecs.items():
                stream = STREAM_SECOND if k == "exp_avg_sq" else STREAM_FIRST
                fields[k] = c.encode(vals[k], rand=words[stream])
        state = {"step": torch.tensor(float(step))}
        for k, c in codecs.items():
            for suffix, t in fields[k].items():
                key = k if suffix == "" else f"{k}_{suffix}"
                state[key] = t[:n].view(p0.shape) if c.block_size == 1 else t
        if code is not None:
            state["master_code"] = code[:n].view(p0.shape)
        out.append((p[:n].view(p0.shape), state))
    return out


def _optimizer_run(rule, hp, master, moments, sr, params, grads, seed=SEED, **extra):
    ps = [p.clone().requires_grad_() for p in params]
    for p in ps:
        p.grad_dtype = None  # allow float32 gradients on low-precision parameters
    opt = MemOptimizer(
        ps,
        rule=rule,
        master=master,
        moments=moments,
        stochastic_rounding=sr,
        seed=seed,
        **hp,
        **extra,
    )
    for row in grads:
        for p, g in zip(ps, row, strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()
    return ps, opt


@pytest.mark.parametrize("sr", [False, True], ids=["rtn", "sr"])
@pytest.mark.parametrize("moments", MOMENTS)
@pytest.mark.parametrize(("master", "dtype"), MASTERS, ids=[m for m, _ in MASTERS])
@pytest.mark.parametrize("case", list(RULE_CASES))
def test_bit_exact_against_reference_loop(case, master, dtype, moments, sr, device):
    rule = case.split("_")[0]
    hp = RULE_CASES[case]
    params, grads = _make_inputs(dtype, device)
    ps, opt = _optimizer_run(rule, hp, master, moments, sr, params, grads)
    spec = StateSpec(master=master, moments=moments, stochastic_rounding=sr)
    expected = reference_run(rule, hp, spec, params, grads, SEED)
    for i, (p, (ref_p, ref_state)) in enumerate(zip(ps, expected, strict=True)):
        assert p.dtype == dtype
        assert p.shape == ref_p.shape
        assert torch.equal(p.detach(), ref_p), f"parameter {i} {tuple(p.shape)} differs"
        state = opt.state[p]
        assert set(state) == set(ref_state), (sorted(state), sorted(ref_state))
        for key, ref in ref_state.items():
            got = state[key]
            assert got.dtype == ref.dtype, key
            assert got.shape == ref.shape, key
            assert torch.equal(got.cpu(), ref.cpu()), f"state {key!r} of parameter {i} differs"
    # the run moved the parameters (a no-op optimizer would pass the comparisons above)
    moved = [not torch.equal(p.detach(), p0) for p, p0 in zip(ps, params, strict=True) if p.numel()]
    assert any(moved)


@pytest.mark.parametrize("moments", ["fp8", "q8"])
def test_decay_normalized_second_moments_across_periods(moments, device):
    """beta2 = 0.5 renormalizes every 8 steps (reference.decay_norm_period): 20 steps cross two
    period ends, where the stored moment is re-rounded (beta2**8), bit for bit with the loop."""
    assert R.decay_norm_period(0.5) == 8
    hp = dict(lr=1e-2, betas=(0.9, 0.5), weight_decay=0.01)
    params, _ = _make_inputs(torch.float32, device, seed=3)
    gen = torch.Generator().manual_seed(4)
    grads = [
        [
            (torch.randn(p.shape, generator=gen) * (1.0 if t < 4 else 1e-3)).to(device)
            for p in params
        ]
        for t in range(20)
    ]
    ps, opt = _optimizer_run("adamw", hp, "fp32", moments, True, params, grads)
    spec = StateSpec(master="fp32", moments=moments, stochastic_rounding=True)
    expected = reference_run("adamw", hp, spec, params, grads, SEED)
    for p, (ref_p, ref_state) in zip(ps, expected, strict=True):
        assert torch.equal(p.detach(), ref_p)
        for key, ref in ref_state.items():
            assert torch.equal(opt.state[p][key].cpu(), ref.cpu()), key
    assert opt.decay_norm(0, 20) == 0.5**4


def test_fp16_parameters_with_master_none(device):
    params, grads = _make_inputs(torch.float16, device, seed=5)
    for sr in (False, True):
        ps, _ = _optimizer_run("adamw", RULE_CASES["adamw"], "none", "q8", sr, params, grads)
        spec = StateSpec(master="none", moments="q8", stochastic_rounding=sr)
        expected = reference_run("adamw", RULE_CASES["adamw"], spec, params, grads, SEED)
        for p, (ref_p, _) in zip(ps, expected, strict=True):
            assert torch.equal(p.detach(), ref_p)


def test_seed_changes_stochastic_rounding_only(device):
    params, grads = _make_inputs(torch.bfloat16, device, seed=2)
    a, _ = _optimizer_run("adamw", RULE_CASES["adamw"], "none", "bf16", True, params, grads, seed=1)
    b, _ = _optimizer_run("adamw", RULE_CASES["adamw"], "none", "bf16", True, params, grads, seed=2)
    c, _ = _optimizer_run(
        "adamw", RULE_CASES["adamw"], "none", "bf16", False, params, grads, seed=1
    )
    d, _ = _optimizer_run(
        "adamw", RULE_CASES["adamw"], "none", "bf16", False, params, grads, seed=2
    )
    assert not all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(c, d, strict=True))


# ------------------------------------------------------------------------------ vs torch.optim
EPS32 = torch.finfo(torch.float32).eps
N = 2047  # below the size where torch parallelizes elementwise ops (slow on busy CI hosts)
LONG = 120


def _long_grads(seed: int, device):
    gen = torch.Generator().manual_seed(seed)
    # alternate scales: both the eps-dominated and the v-dominated regimes of Adam
    return [
        (torch.randn(N, generator=gen) * (1e-3 if t % 3 == 0 else 1.0)).to(device)
        for t in range(LONG)
    ]


def _torch_run(cls, p0, hp, grads):
    p = torch.nn.Parameter(p0.clone())
    opt = cls([p], foreach=False, **hp)
    path = torch.zeros_like(p0)
    for g in grads:
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        path += (p.detach() - before).abs()
    return p.detach(), path


def _ours(rule, p0, hp, grads):
    p = torch.nn.Parameter(p0.clone())
    opt = MemOptimizer([p], rule=rule, moments="fp32", **hp)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def assert_within_movement(ours, theirs, path):
    """|ours - torch| <= 4 ulps of (|p| + distance travelled), per element (DESIGN section 4)."""
    bound = 4 * EPS32 * (theirs.abs() + path)
    excess = ((ours - theirs).abs() - bound).max().item()
    assert excess <= 0, f"differs from torch.optim by more than 4 ulps of the movement ({excess})"


TORCH_CASES = [
    ("adamw", torch.optim.AdamW, dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    ("adamw", torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01, maximize=True)),
    ("adam", torch.optim.Adam, dict(lr=1e-3, weight_decay=0.05)),
    ("adam", torch.optim.Adam, dict(lr=1e-2, betas=(0.9, 0.95), maximize=True)),
    ("sgd", torch.optim.SGD, dict(lr=0.05)),
    ("sgd", torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-2)),
    ("sgd", torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    ("sgd", torch.optim.SGD, dict(lr=0.02, momentum=0.8, dampening=0.3, maximize=True)),
]


@pytest.mark.parametrize(("rule", "cls", "hp"), TORCH_CASES)
def test_fp32_matches_torch_optim(rule, cls, hp, device):
    p0 = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(device)
    grads = _long_grads(9, device)
    theirs, path = _torch_run(cls, p0, hp, grads)
    assert_within_movement(_ours(rule, p0, hp, grads), theirs, path)


def test_movement_bound_catches_a_missing_bias_correction(device):
    hp = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    p0 = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(device)
    grads = _long_grads(9, device)
    theirs, path = _torch_run(torch.optim.AdamW, p0, hp, grads)
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for t, g in enumerate(grads, start=1):
        s = R.adam_scalars(**hp, step=t, decoupled=True)
        s = dataclasses.replace(s, bc2_sqrt=1.0)  # second-moment bias correction missing
        p, m, v = R.adam(p, g, m, v, s)
    with pytest.raises(AssertionError, match="more than 4 ulps"):
        assert_within_movement(p, theirs, path)
    # and a wrong decay (L2 instead of decoupled) is caught too
    wrong = _ours("adam", p0, hp, grads)
    with pytest.raises(AssertionError, match="more than 4 ulps"):
        assert_within_movement(wrong, theirs, path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["adamw", "sgd", "lion"])
@pytest.mark.parametrize(
    ("master", "moments"), [("fp32", "fp32"), ("ecc24", "q8"), ("none", "fp8")]
)
def test_cpu_and_cuda_give_the_same_bits(case, master, moments):
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    params, grads = _make_inputs(dtype, "cpu", seed=4)
    results = []
    for dev in ("cpu", "cuda"):
        ps_dev = [p.to(dev) for p in params]
        gs_dev = [[None if g is None else g.to(dev) for g in row] for row in grads]
        ps, _ = _optimizer_run(case, RULE_CASES[case], master, moments, True, ps_dev, gs_dev)
        results.append([p.detach().cpu() for p in ps])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
