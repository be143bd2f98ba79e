"""Interop with torch.optim: torch checkpoints resume in memopt and memopt states load into torch.

Resumed training is compared with torch continuing on the same gradients within the bound
memopt's reference keeps against torch.optim (memopt-core's test_reference.py): per element
``4 * eps32 * (|p| + path)``, ``path`` the distance the parameter travelled since the hand-over
(torch fuses multiply-adds, memopt rounds every operation; a lost or misplaced moment misses the
bound by orders of magnitude). Moments are compared bit for bit where the format is fp32, and
against the stated quantization bound where it is not.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memopt_checkpoint.interop import (
    QUANTIZATION_BOUNDS,
    load_torch_state_dict,
    quantization_bound,
    quantization_error_bound,
    to_torch_state_dict,
    torch_optimizer_class,
)
from memopt_core import MemOptimizer, conversions
from memopt_core.errors import ConfigError, StateDictError
from memopt_core.formats import MOMENT_FORMATS, MOMENT_PRESETS, master_codec, moment_codec
from memopt_core.plan import state_key

EPS32 = torch.finfo(torch.float32).eps
ADAM_KW = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)
SGD_KW = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)


class Net(nn.Module):
    """fp32 model; sizes that are not multiples of the 32-element blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.norm = nn.LayerNorm(12)
        self.out = nn.Linear(12, 3)

    def forward(self, x):
        return self.out(self.norm(torch.tanh(self.inp(x))))


class MixedNet(nn.Module):
    """bf16 linears around an fp32 LayerNorm (a norm kept in full precision)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 40)
        self.norm = nn.LayerNorm(40)
        self.out = nn.Linear(40, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x.to(self.inp.weight.dtype)))
        h = self.norm(h.float()).to(self.out.weight.dtype)
        return self.out(h).float()


def cast_mixed(model: MixedNet) -> MixedNet:
    model.inp.to(torch.bfloat16)
    model.out.to(torch.bfloat16)
    return model


def batch(t: int):
    gen = torch.Generator().manual_seed(100 + t)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def backward(model: nn.Module, t: int) -> None:
    x, y = batch(t)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for t in range(start, start + steps):
        backward(model, t)
        opt.step()


def continue_both(ref, ref_opt, mine, my_opt, steps: int, start: int) -> list[torch.Tensor]:
    """Step both optimizers on ``ref``'s gradients; returns each parameter's travelled distance."""
    ref_params, my_params = list(ref.parameters()), list(mine.parameters())
    path = [torch.zeros_like(p) for p in ref_params]
    for t in range(start, start + steps):
        backward(ref, t)
        for p, q in zip(ref_params, my_params, strict=True):
            q.grad = p.grad.detach().clone()
        before = [p.detach().clone() for p in ref_params]
        ref_opt.step()
        my_opt.step()
        for d, p, b in zip(path, ref_params, before, strict=True):
            d += (p.detach() - b).abs()
    return path


def assert_close_to_torch(mine: nn.Module, ref: nn.Module, path: list[torch.Tensor]) -> None:
    for q, p, d in zip(mine.parameters(), ref.parameters(), path, strict=True):
        bound = 4 * EPS32 * (p.detach().abs() + d)
        excess = ((q.detach() - p.detach()).abs() - bound).max().item()
        assert excess <= 0, f"memopt and torch diverged beyond the reference bound ({excess})"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.detach().contiguous().view(ints), b.detach().contiguous().view(ints))


def decoded(opt: MemOptimizer, p: torch.Tensor, name: str) -> torch.Tensor:
    """memopt's moment ``name`` of ``p`` decoded to fp32, shaped like ``p`` (independent of
    interop: the codec applied to the state's fields)."""
    group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    first, second = MOMENT_PRESETS[group["moments"]]
    codec = moment_codec(second if name == "exp_avg_sq" else first)
    st = opt.state[p]
    x = codec.decode({sfx: st[state_key(name, sfx)] for sfx in codec.fields})
    return x.reshape(-1)[: p.numel()].reshape(p.shape)


def decay_norm(beta2: float, step: int) -> float:
    """``N = beta2**(step % P)``, ``P`` the largest count with ``beta2**P >= 2**-8``: an 8-bit
    (fp8, q8) second moment after ``step`` steps is stored as ``u = v / N`` (computed here, not
    by memopt-core)."""
    period = 1
    while beta2 ** (period + 1) >= 2.0**-8:
        period += 1
    return beta2 ** (step % period)


def norm_of(opt: MemOptimizer, p: torch.Tensor) -> float:
    """:func:`decay_norm` of ``p``'s group and step where its second moment is normalized (an
    Adam rule with fp8 / q8 moments), else 1."""
    group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
    if group["moments"] not in ("fp8", "q8") or opt.rule not in ("adam", "adamw"):
        return 1.0
    return decay_norm(float(group["betas"][1]), int(opt.state[p]["step"].item()))


def torch_value(opt: MemOptimizer, p: torch.Tensor, name: str) -> torch.Tensor:
    """The fp32 value torch holds for memopt's moment ``name`` of ``p``: :func:`decoded`, and
    for ``exp_avg_sq`` Adam's ``v = u * N`` (one rounding, from double)."""
    x = decoded(opt, p, name)
    if name != "exp_avg_sq":
        return x
    return (x.double() * norm_of(opt, p)).float()


def snapshot(opt: MemOptimizer, model: nn.Module):
    sd = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in model.parameters()]
    return sd, params


def assert_unchanged(before, opt: MemOptimizer, model: nn.Module) -> None:
    sd, params = before
    now = opt.state_dict()
    assert now["state"].keys() == sd["state"].keys()
    for key, entry in sd["state"].items():
        assert now["state"][key].keys() == entry.keys()
        for k, v in entry.items():
            assert same_bits(now["state"][key][k], v), (key, k)
    for g_now, g_then in zip(now["param_groups"], sd["param_groups"], strict=True):
        assert g_now == g_then
    for p, v in zip(model.parameters(), params, strict=True):
        assert same_bits(p, v)


def torch_group_keys(cls: type[torch.optim.Optimizer], **kw) -> set[str]:
    p = torch.zeros(1, requires_grad=True)
    return set(cls([p], **kw).state_dict()["param_groups"][0])


ADAMS = [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam)]


# ------------------------------------------------------------------------ torch -> memopt
@pytest.mark.parametrize(("rule", "cls"), ADAMS, ids=["adamw", "adam"])
def test_torch_adam_checkpoint_resumes_in_memopt(rule, cls):
    torch.manual_seed(0)
    ref = Net()
    mine = copy.deepcopy(ref)
    ref_opt = cls(ref.parameters(), foreach=False, **ADAM_KW)
    train(ref, ref_opt, 5)
    mine.load_state_dict(ref.state_dict())
    my_opt = MemOptimizer(mine.parameters(), rule=rule, moments="fp32")  # other hyperparameters
    load_torch_state_dict(my_opt, ref_opt.state_dict())

    for p, q in zip(ref.parameters(), mine.parameters(), strict=True):
        theirs, ours = ref_opt.state[p], my_opt.state[q]
        assert same_bits(ours["exp_avg"], theirs["exp_avg"])
        assert same_bits(ours["exp_avg_sq"], theirs["exp_avg_sq"])
        assert ours["step"].item() == theirs["step"].item() == 5
    group = my_opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"]) == (1e-2, (0.8, 0.99), 1e-7)
    assert group["weight_decay"] == 0.05

    path = continue_both(ref, ref_opt, mine, my_opt, 5, start=5)
    assert_close_to_torch(mine, ref, path)


@pytest.mark.parametrize("moments", ["bf16", "fp8", "q8"])
def test_torch_moments_load_within_the_stated_bound(moments):
    torch.manual_seed(1)
    ref = Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAM_KW)
    train(ref, ref_opt, 5)
    sd = ref_opt.state_dict()
    mine = copy.deepcopy(ref)
    my_opt = MemOptimizer(mine.parameters(), rule="adamw", moments=moments)  # SR on for steps
    load_torch_state_dict(my_opt, sd)
    again = MemOptimizer(copy.deepcopy(ref).parameters(), rule="adamw", moments=moments, seed=9)
    load_torch_state_dict(again, sd)

    first, second = MOMENT_PRESETS[moments]
    moved = 0
    for p, q, r in zip(
        ref.parameters(), mine.parameters(), again.param_groups[0]["params"], strict=True
    ):
        for name, fmt in (("exp_avg", first), ("exp_avg_sq", second)):
            x = ref_opt.state[p][name]
            if name == "exp_avg_sq":  # fp8 / q8 store u = v / N: the value encoded
                norm = norm_of(my_opt, q)
                assert (norm == 1.0) == (moments == "bf16")
                x = conversions.normalize_second_moment(x, norm)
                exact = ref_opt.state[p][name].double() / norm
                assert ((x.double() - exact).abs() <= exact * EPS32).all()
            y = decoded(my_opt, q, name)
            err = (y.double() - x.double()).abs()
            assert (err <= quantization_error_bound(fmt, x)).all(), (name, fmt)
            moved += int((err > 0).sum())
            # round to nearest even: deterministic, the codec's own RNE encoding
            for sfx in moment_codec(fmt).fields:
                assert same_bits(
                    my_opt.state[q][state_key(name, sfx)], again.state[r][state_key(name, sfx)]
                )
    assert moved > 0  # the format did quantize


# ------------------------------------------------------------------------ memopt -> torch
@pytest.mark.parametrize(("rule", "cls"), ADAMS, ids=["adamw", "adam"])
def test_memopt_fp32_state_loads_into_torch_bit_identical(rule, cls):
    torch.manual_seed(2)
    mine = Net()
    my_opt = MemOptimizer(mine.parameters(), rule=rule, moments="fp32", **ADAM_KW)
    train(mine, my_opt, 5)
    sd = to_torch_state_dict(my_opt)
    assert torch_optimizer_class(my_opt) is cls
    assert set(sd["param_groups"][0]) == torch_group_keys(cls)

    ref = copy.deepcopy(mine)
    ref_opt = cls(ref.parameters(), lr=0.5, foreach=False)  # hyperparameters come from sd
    ref_opt.load_state_dict(sd)
    assert ref_opt.param_groups[0]["lr"] == 1e-2
    assert ref_opt.param_groups[0]["betas"] == (0.8, 0.99)
    assert ref_opt.param_groups[0]["weight_decay"] == 0.05
    for p, q in zip(ref.parameters(), mine.parameters(), strict=True):
        theirs, ours = ref_opt.state[p], my_opt.state[q]
        assert same_bits(theirs["exp_avg"], ours["exp_avg"])
        assert same_bits(theirs["exp_avg_sq"], ours["exp_avg_sq"])
        assert theirs["step"].dtype == torch.float32
        assert theirs["step"].item() == 5
    # the export holds copies, not views of memopt's arenas (torch's load keeps fp32 tensors)
    first = my_opt.state[next(mine.parameters())]["exp_avg"]
    kept = first.clone()
    to_torch_state_dict(my_opt)["state"][0]["exp_avg"].add_(1.0)
    assert same_bits(first, kept)

    # memopt -> torch -> memopt: bit-identical
    back_model = copy.deepcopy(mine)
    back = MemOptimizer(back_model.parameters(), rule=rule, moments="fp32")
    load_torch_state_dict(back, to_torch_state_dict(my_opt))
    for q, r in zip(mine.parameters(), back_model.parameters(), strict=True):
        assert my_opt.state[q].keys() == back.state[r].keys()
        for k, v in my_opt.state[q].items():
            assert same_bits(back.state[r][k], v), k

    # and torch resumes where memopt stopped
    path = continue_both(ref, ref_opt, mine, my_opt, 5, start=5)
    assert_close_to_torch(mine, ref, path)


def test_torch_groups_never_take_the_memopt_entry():
    """state_dict() puts memopt's 'memopt' entry in every param group, and torch's
    load_state_dict copies a saved group's keys into its live groups: the export leaves it out,
    so a torch AdamW holds none, and the way back leaves the memopt groups without it too."""
    torch.manual_seed(4)
    mine = Net()
    my_opt = MemOptimizer(mine.parameters(), rule="adamw", moments="q8", seed=6, **ADAM_KW)
    train(mine, my_opt, 3)
    assert all("memopt" in g for g in my_opt.state_dict()["param_groups"])
    sd = to_torch_state_dict(my_opt)
    assert "memopt" not in sd
    assert all("memopt" not in g for g in sd["param_groups"])
    ref = copy.deepcopy(mine)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False)
    ref_opt.load_state_dict(sd)
    assert all("memopt" not in g for g in ref_opt.param_groups)
    train(ref, ref_opt, 1, start=3)
    back = MemOptimizer(copy.deepcopy(ref).parameters(), rule="adamw", moments="q8", seed=9)
    load_torch_state_dict(back, ref_opt.state_dict())
    assert back.seed == 9  # torch's dict has none: the optimizer's own
    assert all("memopt" not in g for g in back.param_groups)
    assert all(
        # the normalizing beta2 of its q8 second moments: the torch dict's
        g["memopt"] == {"rule": "adamw", "seed": 9, "version": 2, "decay_norm_beta2": [0.99]}
        for g in back.state_dict()["param_groups"]
    )


@pytest.mark.parametrize(
    ("moments", "beta2", "steps"),
    [
        ("bf16", 0.99, 5),
        ("fp8", 0.99, 5),
        ("q8", 0.99, 5),
        # fp8 / q8 second moments are stored as u = v / beta2**(k % P): exported one step
        # before a period's end (P = 8 for 0.5, 52 for 0.9), continued across it
        ("fp8", 0.5, 7),
        ("q8", 0.5, 7),
        ("fp8", 0.9, 51),
        ("q8", 0.9, 51),
    ],
)
def test_memopt_quantized_state_exports_its_decoded_values(moments, beta2, steps):
    torch.manual_seed(3)
    mine = Net()
    kw = dict(ADAM_KW, betas=(0.8, beta2))
    my_opt = MemOptimizer(mine.parameters(), rule="adamw", moments=moments, **kw)
    train(mine, my_opt, steps)
    sd = to_torch_state_dict(my_opt)
    ref = copy.deepcopy(mine)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False)
    ref_opt.load_state_dict(sd)
    back_model = copy.deepcopy(mine)
    back = MemOptimizer(back_model.parameters(), rule="adamw", moments=moments)
    load_torch_state_dict(back, sd)
    for i, (q, p, r) in enumerate(
        zip(mine.parameters(), ref.parameters(), back_model.parameters(), strict=True)
    ):
        for name in ("exp_avg", "exp_avg_sq"):
            # no loss beyond the format; exp_avg_sq is v, the stored u times N
            exact = torch_value(my_opt, q, name)
            assert same_bits(sd["state"][i][name], exact), (i, name)
            assert same_bits(ref_opt.state[p][name], exact)
            # memopt -> torch -> memopt: the same values (error 0, within any bound)
            assert same_bits(decoded(back, r, name), decoded(my_opt, q, name)), (i, name)
            assert same_bits(torch_value(back, r, name), exact), (i, name)
    # so training goes on bit for bit as if nothing happened (steps and seed kept)
    for t in range(steps, steps + 3):
        for model, opt in ((mine, my_opt), (back_model, back)):
            backward(model, t)
            opt.step()
    for q, r in zip(mine.parameters(), back_model.parameters(), strict=True):
        assert same_bits(q, r)


@pytest.mark.parametrize("moments", ["fp8", "q8"])
@pytest.mark.parametrize(("beta2", "steps"), [(0.5, 13), (0.9, 100)])
def test_exported_second_moment_tracks_torchs(moments, beta2, steps):
    """memopt and torch's AdamW step on the same gradients (drawn per step, not from the
    weights). After ``steps`` (P = 8 for 0.5, 52 for 0.9: N = beta2**5, beta2**48, far from 1)
    the exported exp_avg_sq is Adam's v, within the format's error of torch's: each step
    re-rounds it (2 significant bits in e5m2, 5 in q8's sqrt), so per element a few roundings
    apart, and unbiased in sum (stochastic rounding). u itself would be 1/N times too large."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(512))
    q = nn.Parameter(p.detach().clone())
    kw = dict(lr=1e-3, betas=(0.9, beta2), weight_decay=0.01)
    my_opt = MemOptimizer([p], rule="adamw", moments=moments, **kw)
    ref_opt = torch.optim.AdamW([q], foreach=False, **kw)
    gen = torch.Generator().manual_seed(1)
    scale = torch.linspace(0.5, 2.0, 512)
    for _ in range(steps):
        g = torch.randn(512, generator=gen) * scale
        p.grad, q.grad = g.clone(), g.clone()
        my_opt.step()
        ref_opt.step()
    assert norm_of(my_opt, p) < 2.0**-4
    v = to_torch_state_dict(my_opt)["state"][0]["exp_avg_sq"].double()
    assert same_bits(v.float(), torch_value(my_opt, p, "exp_avg_sq"))
    ref = ref_opt.state[q]["exp_avg_sq"].double()
    rel = (v - ref).abs() / ref
    median, worst = (0.1, 0.6) if moments == "q8" else (0.2, 1.5)
    assert rel.median() <= median, rel.median().item()
    assert rel.max() <= worst, rel.max().item()
    assert abs(v.sum() / ref.sum() - 1.0) <= 0.05


@pytest.mark.parametrize("moments", ["fp8", "q8"])
def test_torch_memopt_torch_keeps_v_within_the_bound(moments):
    """torch -> memopt -> torch: the exported v is torch's within the format's stated bound
    (of v: the normalization scales the value and its block alike), at a step whose N is
    0.5**5; and exported again into the same memopt optimizer, nothing changes."""
    torch.manual_seed(11)
    ref = Net()
    kw = dict(ADAM_KW, betas=(0.8, 0.5))
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **kw)
    train(ref, ref_opt, 13)
    sd = ref_opt.state_dict()
    mine = copy.deepcopy(ref)
    my_opt = MemOptimizer(mine.parameters(), rule="adamw", moments=moments)
    load_torch_state_dict(my_opt, sd)
    assert my_opt.param_groups[0]["betas"] == (0.8, 0.5)
    back = to_torch_state_dict(my_opt)
    second = MOMENT_PRESETS[moments][1]
    for i, (p, q) in enumerate(zip(ref.parameters(), mine.parameters(), strict=True)):
        assert norm_of(my_opt, q) == 0.5**5
        x = ref_opt.state[p]["exp_avg_sq"]
        y = back["state"][i]["exp_avg_sq"]
        assert same_bits(y, torch_value(my_opt, q, "exp_avg_sq"))
        err = (y.double() - x.double()).abs()
        # (1 + 2**-20): the fp32 roundings of v / N and u * N, far below the format's
        assert (err <= quantization_error_bound(second, x) * (1 + 2.0**-20)).all(), i
        assert (err > 0).any()
        assert same_bits(back["state"][i]["exp_avg"], decoded(my_opt, q, "exp_avg"))
    # (a block may come back with a lower scale and codes scaled to match: compare values)
    names = ("exp_avg", "exp_avg_sq")
    values = {q: [decoded(my_opt, q, m) for m in names] for q in mine.parameters()}
    load_torch_state_dict(my_opt, back)
    for q in mine.parameters():
        for m, v in zip(names, values[q], strict=True):
            assert same_bits(decoded(my_opt, q, m), v), m


@pytest.mark.parametrize("moments", ["fp32", "q8"])
def test_exported_states_own_their_memory(moments):
    """Net's sizes are not multiples of 32: a moment must not be a view of memopt's arena or of
    a padded buffer, which torch.save would store whole (and a later step would change)."""
    torch.manual_seed(3)
    model = Net()
    opt = MemOptimizer(model.parameters(), rule="adamw", moments=moments, **ADAM_KW)
    train(model, opt, 2)
    arena_ptrs = {t.untyped_storage().data_ptr() for s in opt.state.values() for t in s.values()}
    sd = to_torch_state_dict(opt)
    for entry in sd["state"].values():
        for name in ("exp_avg", "exp_avg_sq"):
            t = entry[name]
            assert t.untyped_storage().nbytes() == t.nbytes, name
            assert t.untyped_storage().data_ptr() not in arena_ptrs, name


def test_memopt_decouple_lr_exports_an_equivalent_weight_decay():
    torch.manual_seed(4)
    mine = Net()
    my_opt = MemOptimizer(
        mine.parameters(), rule="adamw", lr=1e-2, weight_decay=0.1, decouple_lr=True
    )
    train(mine, my_opt, 3)
    sd = to_torch_state_dict(my_opt)
    assert sd["param_groups"][0]["weight_decay"] == pytest.approx(0.1 / 1e-2)
    ref = copy.deepcopy(mine)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False)
    ref_opt.load_state_dict(sd)
    path = continue_both(ref, ref_opt, mine, my_opt, 5, start=3)
    assert_close_to_torch(mine, ref, path)


def test_decouple_lr_switched_on_by_hand_exports_before_its_first_step():
    """A group's ``decouple_lr`` switched on by hand has no ``initial_lr`` until the next step
    records its lr; the export raised a bare ``KeyError: 'initial_lr'`` (adversarial testing,
    2026-12-06). It divides by that lr, as the step will, and changes nothing in the group."""
    torch.manual_seed(4)
    model = Net()
    opt = MemOptimizer(model.parameters(), rule="adamw", lr=1e-2, weight_decay=0.1)
    opt.param_groups[0]["decouple_lr"] = True
    before = to_torch_state_dict(opt)["param_groups"][0]
    assert before["weight_decay"] == 0.1 / 1e-2
    assert "initial_lr" not in before
    assert "initial_lr" not in opt.param_groups[0]  # the export records nothing
    train(model, opt, 1)
    assert opt.param_groups[0]["initial_lr"] == 1e-2
    after = to_torch_state_dict(opt)["param_groups"][0]
    assert after.pop("initial_lr") == 1e-2
    assert after == before

    # an lr the step would refuse to record: a ConfigError saying so, not a ZeroDivisionError
    opt = MemOptimizer(Net().parameters(), rule="adamw", lr=0.0, weight_decay=0.1)
    opt.param_groups[0]["decouple_lr"] = True
    with pytest.raises(ConfigError, match=r"group 0 has decouple_lr=True.*initial lr .* is 0\.0"):
        to_torch_state_dict(opt)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("lr", -1.0, "learning rate"),
        ("betas", (0.9, 1.0), "beta"),
        ("eps", -1e-8, "invalid eps"),
        ("moments", "q4", "unknown moment format 'q4'"),
    ],
)
def test_an_export_refuses_group_values_the_step_refuses(key, value, message):
    """A hand edit the next step would refuse was exported as it was (a helper's hunt,
    2026-12-07): torch's load_state_dict checks nothing, and its step ran lr=-1 (ascent)."""
    torch.manual_seed(4)
    model = Net()
    opt = MemOptimizer(model.parameters(), rule="adamw", moments="q8")
    train(model, opt, 1)
    opt.param_groups[0][key] = value
    with pytest.raises(
        ConfigError, match=rf"(?i){message}.*param group 0|param group 0.*{message}"
    ):
        to_torch_state_dict(opt)


# ------------------------------------------------------------------------ mixed bf16 / fp32
def _mixed_optimizer(kind: str, model: nn.Module) -> MemOptimizer:
    if kind == "flash":
        ecc = pytest.importorskip("memopt_ecc")
        return ecc.FlashAdamW(model.parameters(), lr=1e-2, master_weight_bits=24, quantize=True)
    return MemOptimizer(
        model.parameters(), rule="adamw", lr=1e-2, weight_decay=1e-2, master="ecc24", moments="q8"
    )


def _fp32_weights(opt: MemOptimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.dtype == torch.float32:
            out[name] = p.detach().clone()
        else:
            code = opt.state[p]["master_code"]
            out[name] = (
                master_codec("ecc24", p.dtype)
                .decode(p.detach().reshape(-1), code.reshape(-1))
                .view(p.shape)
            )
    return out


@pytest.mark.parametrize("kind", ["core", "flash"])
def test_mixed_bf16_fp32_model_keeps_every_moment(kind):
    torch.manual_seed(5)
    model = cast_mixed(MixedNet())
    opt = _mixed_optimizer(kind, model)
    train(model, opt, 5)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16, torch.float32}
    sd = to_torch_state_dict(opt)

    # every parameter, the fp32 norm included, exports its first AND second moment
    assert sorted(sd["state"]) == list(range(len(params)))
    for i, (name, p) in enumerate(params.items()):
        entry = sd["state"][i]
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}, name
        for m in ("exp_avg", "exp_avg_sq"):
            assert entry[m].dtype == torch.float32
            assert entry[m].shape == p.shape
            assert entry[m].abs().sum() > 0, (name, m)  # FlashOptim 0.1.4 loses fp32 exp_avg
            assert same_bits(entry[m], torch_value(opt, p, m)), (name, m)

    # the vanilla route: fp32 weights (ECC decoded) + these moments in torch.optim.AdamW
    weights = _fp32_weights(opt, model)
    if kind == "flash":
        ecc = pytest.importorskip("memopt_ecc")
        for k, v in ecc.get_fp32_model_state_dict(model, opt).items():
            assert same_bits(v, weights[k]), k
    ref = MixedNet()
    ref.load_state_dict(weights)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False)
    ref_opt.load_state_dict(sd)
    for i, p in enumerate(ref.parameters()):
        for m in ("exp_avg", "exp_avg_sq"):
            assert same_bits(ref_opt.state[p][m], sd["state"][i][m])

    # back into the same optimizer: moment values unchanged (decoded values are on the grid; a
    # block's scale may come out lower, with codes scaled to match), master codes and steps kept
    before = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in params.items()}
    values = {n: [decoded(opt, p, m) for m in ("exp_avg", "exp_avg_sq")] for n, p in params.items()}
    load_torch_state_dict(opt, sd)
    for n, p in params.items():
        assert opt.state[p].keys() == before[n].keys(), n
        assert ("master_code" in before[n]) == (p.dtype == torch.bfloat16), n
        if "master_code" in before[n]:
            assert same_bits(opt.state[p]["master_code"], before[n]["master_code"]), n
        assert same_bits(opt.state[p]["step"], before[n]["step"])
        for m, v in zip(("exp_avg", "exp_avg_sq"), values[n], strict=True):
            assert same_bits(decoded(opt, p, m), v), (n, m)

    # torch trains on (its moments leave memopt's grid) and hands back: within the bound, for
    # every parameter and both moments
    train(ref, ref_opt, 2, start=5)
    load_torch_state_dict(opt, ref_opt.state_dict())
    first, second = MOMENT_PRESETS["q8"]
    for (n, p), r in zip(params.items(), ref.parameters(), strict=True):
        assert opt.state[p]["step"].item() == 7
        for m, fmt in (("exp_avg", first), ("exp_avg_sq", second)):
            x = ref_opt.state[r][m]
            if m == "exp_avg_sq":  # q8 stores u = v / N: the value encoded
                x = conversions.normalize_second_moment(x, norm_of(opt, p))
            y = decoded(opt, p, m)
            assert y.abs().sum() > 0, (n, m)
            assert ((y.double() - x.double()).abs() <= quantization_error_bound(fmt, x)).all(), (
                n,
                m,
            )
    opt.zero_grad()
    train(model, opt, 1, start=7)  # and memopt steps on from there


def test_params_without_torch_state_start_fresh_and_keep_their_master_code():
    torch.manual_seed(6)
    model = cast_mixed(MixedNet())
    opt = _mixed_optimizer("core", model)
    train(model, opt, 3)
    p0 = model.inp.weight
    code = opt.state[p0]["master_code"].clone()
    sd = to_torch_state_dict(opt)
    del sd["state"][0]
    load_torch_state_dict(opt, sd)
    assert opt.state[p0]["step"].item() == 0
    assert decoded(opt, p0, "exp_avg").abs().sum() == 0
    assert decoded(opt, p0, "exp_avg_sq").abs().sum() == 0
    assert same_bits(opt.state[p0]["master_code"], code)
    assert opt.state[model.norm.weight]["step"].item() == 3


# ------------------------------------------------------------------------------------ SGD
def test_torch_sgd_resumes_in_memopt():
    torch.manual_seed(7)
    ref = Net()
    ref_opt = torch.optim.SGD(ref.parameters(), foreach=False, **SGD_KW)
    train(ref, ref_opt, 5)
    mine = copy.deepcopy(ref)
    my_opt = MemOptimizer(mine.parameters(), rule="sgd", momentum=0.5)
    load_torch_state_dict(my_opt, ref_opt.state_dict())
    group = my_opt.param_groups[0]
    assert (group["momentum"], group["dampening"], group["weight_decay"]) == (0.9, 0.1, 0.01)
    for p, q in zip(ref.parameters(), mine.parameters(), strict=True):
        assert same_bits(my_opt.state[q]["momentum_buffer"], ref_opt.state[p]["momentum_buffer"])
        assert my_opt.state[q]["step"].item() >= 1  # past the first (buf = g) step
    path = continue_both(ref, ref_opt, mine, my_opt, 5, start=5)
    assert_close_to_torch(mine, ref, path)


def test_memopt_sgd_state_loads_into_torch():
    torch.manual_seed(8)
    mine = Net()
    my_opt = MemOptimizer(
        mine.parameters(), rule="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01
    )
    train(mine, my_opt, 5)
    sd = to_torch_state_dict(my_opt)
    assert set(sd["param_groups"][0]) == torch_group_keys(torch.optim.SGD)
    ref = copy.deepcopy(mine)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0, foreach=False)
    ref_opt.load_state_dict(sd)
    assert ref_opt.param_groups[0]["nesterov"] is True
    for p, q in zip(ref.parameters(), mine.parameters(), strict=True):
        assert set(ref_opt.state[p]) == {"momentum_buffer"}
        assert same_bits(ref_opt.state[p]["momentum_buffer"], my_opt.state[q]["momentum_buffer"])
    back_model = copy.deepcopy(mine)
    back = MemOptimizer(back_model.parameters(), rule="sgd")
    load_torch_state_dict(back, sd)
    for q, r in zip(mine.parameters(), back_model.parameters(), strict=True):
        assert same_bits(back.state[r]["momentum_buffer"], my_opt.state[q]["momentum_buffer"])
    path = continue_both(ref, ref_opt, mine, my_opt, 5, start=5)
    assert_close_to_torch(mine, ref, path)


def test_sgd_state_before_the_first_step_exports_no_buffer():
    # torch's first step sets buf = g; an exported zero buffer would dampen it instead
    model = Net()
    opt = MemOptimizer(model.parameters(), rule="sgd", momentum=0.9, dampening=0.5)
    opt.init_state()
    assert to_torch_state_dict(opt)["state"] == {}
    other = Net()
    plain = MemOptimizer(other.parameters(), rule="sgd", lr=0.1)  # no momentum: no torch state
    train(other, plain, 2)
    assert to_torch_state_dict(plain)["state"] == {}


# ---------------------------------------------------------------------- refusals and errors
def test_lion_and_sgdw_with_decay_have_no_torch_counterpart():
    lion = MemOptimizer(Net().parameters(), rule="lion")
    with pytest.raises(ConfigError, match="no Lion"):
        to_torch_state_dict(lion)
    ref_opt = torch.optim.AdamW(Net().parameters())
    with pytest.raises(ConfigError, match="no Lion"):
        load_torch_state_dict(lion, ref_opt.state_dict())
    sgdw = MemOptimizer(Net().parameters(), rule="sgdw", momentum=0.9, weight_decay=0.1)
    with pytest.raises(ConfigError, match="L2"):
        to_torch_state_dict(sgdw)
    with pytest.raises(TypeError, match="memopt optimizer"):  # as memopt_ecc's conversions
        to_torch_state_dict(ref_opt)


def _adamw_setup():
    torch.manual_seed(9)
    ref = Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False)
    train(ref, ref_opt, 2)
    mine = copy.deepcopy(ref)
    my_opt = MemOptimizer(mine.parameters(), rule="adamw", lr=3e-3, moments="q8")
    train(mine, my_opt, 2)
    return ref_opt, mine, my_opt


def _sgd_dict():
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    train(ref, opt, 1)
    return opt.state_dict()


def _adam_dict():
    ref = Net()
    opt = torch.optim.Adam(ref.parameters())
    train(ref, opt, 1)
    return opt.state_dict()


def _set(sd, path, value):
    *head, last = path
    for k in head:
        sd = sd[k]
    sd[last] = value


BAD = {
    "amsgrad": (lambda sd: _set(sd, ["param_groups", 0, "amsgrad"], True), "amsgrad=True"),
    "max_exp_avg_sq": (
        lambda sd: _set(sd, ["state", 3, "max_exp_avg_sq"], sd["state"][3]["exp_avg_sq"]),
        "parameter index 3 .*AMSGrad",
    ),
    "extra group": (
        lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0], params=[99])),
        "2 param group",
    ),
    "params per group": (
        lambda sd: sd["param_groups"][0]["params"].pop(),
        "param group 0 .* 5 parameters, this optimizer's has 6",
    ),
    "shape": (
        lambda sd: _set(sd, ["state", 2, "exp_avg"], torch.zeros(5)),
        r"'exp_avg' of parameter index 2 .*shape \(5,\)",
    ),
    "missing exp_avg_sq": (
        lambda sd: sd["state"][1].pop("exp_avg_sq"),
        r"parameter index 1 .*lacks \['exp_avg_sq'\]",
    ),
    "unknown index": (
        lambda sd: _set(sd, ["state", 42], dict(sd["state"][0])),
        "parameter index 42",
    ),
    "bad step": (lambda sd: _set(sd, ["state", 4, "step"], torch.tensor(2.5)), "parameter index 4"),
    "bad lr": (lambda sd: _set(sd, ["param_groups", 0, "lr"], -1.0), "learning rate"),
    # a bare KeyError and bool("no") == True before (audit round 4)
    "adam moment None": (
        lambda sd: _set(sd, ["state", 1, "exp_avg"], None),
        r"'exp_avg' of parameter index 1 .*is None",
    ),
    "maximize string": (
        lambda sd: _set(sd, ["param_groups", 0, "maximize"], "no"),
        "maximize must be a bool, got 'no'",
    ),
    "integer moment": (
        lambda sd: _set(sd, ["state", 0, "exp_avg"], torch.zeros(12, 6, dtype=torch.int32)),
        "parameter index 0 .*floating",
    ),
    # a raw NotImplementedError from the copy before (adversarial testing, 2026-12-04)
    "meta moment": (
        lambda sd: _set(sd, ["state", 0, "exp_avg_sq"], sd["state"][0]["exp_avg_sq"].to("meta")),
        "'exp_avg_sq' of parameter index 0 .*on the meta device",
    ),
    "index twice": (
        lambda sd: _set(sd, ["param_groups", 0, "params", 1], 0),
        "parameter index 0 appears twice in the state dict",
    ),
    # flags read by truthiness and an unchecked scheduler base (a helper's hunt, 2026-12-07)
    "amsgrad string": (
        lambda sd: _set(sd, ["param_groups", 0, "amsgrad"], "no"),
        "amsgrad must be a bool, got 'no'",
    ),
    "decoupled string": (
        lambda sd: _set(sd, ["param_groups", 0, "decoupled_weight_decay"], "no"),
        "decoupled_weight_decay must be a bool, got 'no'",
    ),
    "initial_lr string": (
        lambda sd: _set(sd, ["param_groups", 0, "initial_lr"], "x"),
        "initial_lr must be a number >= 0, got 'x'",
    ),
    "initial_lr negative": (
        lambda sd: _set(sd, ["param_groups", 0, "initial_lr"], -1.0),
        "initial_lr must be a number >= 0, got -1.0",
    ),
    # q8 stored it as its NaN code, and the next step made NaN weights (a helper's hunt)
    "negative exp_avg_sq": (
        lambda sd: sd["state"][2]["exp_avg_sq"].view(-1)[1].fill_(-1e-12),
        "'exp_avg_sq' of parameter index 2 .*negative values",
    ),
    "memopt dict": (lambda sd: sd.update(memopt={"rule": "adamw"}), "optimizer.load_state_dict"),
    # a memopt state dict through torch's get_state_dict: the entry in the groups only
    "memopt groups": (
        lambda sd: sd["param_groups"][0].update(memopt={"rule": "adamw", "seed": 0, "version": 1}),
        "optimizer.load_state_dict",
    ),
    "sgd dict": (
        lambda sd: sd.update(_sgd_dict()),
        "not a torch.optim.AdamW state dict",
    ),
    "adam dict": (lambda sd: sd.update(_adam_dict()), "decoupled_weight_decay=False"),
    # a bare TypeError (unhashable type: 'list') before (a helper's hunt, 2026-12-07)
    "nested params": (
        lambda sd: _set(sd, ["param_groups", 0, "params"], [[0]]),
        r"'params' must be a list of parameter indices, got \[\[0\]\]",
    ),
}


def test_a_numpy_initial_lr_loads():
    """torch's AdamW under an LR scheduler built with lr=np.float32(1e-3) saves initial_lr as
    numpy's float; a check of the value must take it, as torch does."""
    np = pytest.importorskip("numpy")
    ref_opt, _, my_opt = _adamw_setup()
    sd = copy.deepcopy(ref_opt.state_dict())
    sd["param_groups"][0]["initial_lr"] = np.float32(1e-3)
    load_torch_state_dict(my_opt, sd)
    assert my_opt.param_groups[0]["initial_lr"] == np.float32(1e-3)


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_torch_dict_is_refused_and_changes_nothing(case):
    ref_opt, mine, my_opt = _adamw_setup()
    sd = copy.deepcopy(ref_opt.state_dict())
    mutate, message = BAD[case]
    mutate(sd)
    kept = copy.deepcopy(sd)
    before = snapshot(my_opt, mine)
    with pytest.raises(StateDictError, match=message):
        load_torch_state_dict(my_opt, sd)
    assert_unchanged(before, my_opt, mine)
    assert sd.keys() == kept.keys()
    assert sd["param_groups"] == kept["param_groups"]
    for key, entry in kept["state"].items():
        for k, v in entry.items():
            got = sd["state"][key][k]
            if v is None:
                assert got is None
            elif v.is_meta:  # holds no values to compare
                assert got.is_meta
                assert got.shape == v.shape
            else:
                assert same_bits(got, v)
    # the same optimizer still takes a good dict afterwards
    load_torch_state_dict(my_opt, ref_opt.state_dict())


@pytest.mark.parametrize("wd", [0.01, torch.tensor([0.0, 0.0])], ids=["l2", "two elements"])
def test_sgdw_refuses_torch_l2_decay(wd):
    """(A weight decay of two elements raised a bare ValueError from float().)"""
    sd = _sgd_dict()
    model = Net()
    opt = MemOptimizer(model.parameters(), rule="sgdw", momentum=0.9)
    sd["param_groups"][0]["weight_decay"] = wd
    before = snapshot(opt, model)
    with pytest.raises(StateDictError, match="L2"):
        load_torch_state_dict(opt, sd)
    assert_unchanged(before, opt, model)
    sd["param_groups"][0]["weight_decay"] = 0.0
    load_torch_state_dict(opt, sd)  # without decay SGD and SGDW agree
    assert opt.param_groups[0]["momentum"] == 0.9


# --------------------------------------------------------------------------------- bounds
def _probe(n_blocks: int = 64) -> torch.Tensor:
    """Blocks of 32 from about 1e-34 to 1e36 (2**12 within a block), outliers and zeros."""
    gen = torch.Generator().manual_seed(10)
    mant = torch.rand(n_blocks, 32, generator=gen) + 0.5
    expo = torch.randint(-100, 100, (n_blocks, 1), generator=gen) + torch.randint(
        -12, 1, (n_blocks, 32), generator=gen
    )
    sign = torch.where(torch.rand(n_blocks, 32, generator=gen) < 0.5, -1.0, 1.0)
    x = sign * mant * torch.exp2(expo.float())
    x[::7, 3] *= 1e6  # an outlier per some blocks
    x[::5, 9] = 0.0
    return x.reshape(-1)


@pytest.mark.parametrize("fmt", MOMENT_FORMATS)
def test_quantization_error_bound_holds(fmt):
    codec = moment_codec(fmt)
    # and a block whose small elements lie below the smallest code (e5m2 and q8_sqrt store them
    # as that code, the others as 0)
    x = torch.cat([_probe(), torch.tensor([1.0] + [1e-12] * 15 + [-1e-12] * 16)])
    if fmt == "q8_sqrt":
        x = x.abs()  # a second moment
    y = codec.decode(codec.encode(x))
    err = (y.double() - x.double()).abs()
    bound = quantization_error_bound(fmt, x)
    assert (err <= bound).all(), (err - bound).max().item()
    if fmt == "fp32":
        assert same_bits(y, x)
    else:  # the bound is not loose: errors come within 2x of it somewhere
        assert (err * 2 > bound).any()
    assert isinstance(QUANTIZATION_BOUNDS[fmt], str)


def test_quantization_bound_text():
    assert quantization_bound("fp32").startswith("exact")
    assert "2**-8" in quantization_bound("bf16")
    for preset, (first, second) in MOMENT_PRESETS.items():
        text = quantization_bound(preset)
        assert QUANTIZATION_BOUNDS[first] in text
        assert QUANTIZATION_BOUNDS[second] in text
    assert "6.35%" in quantization_bound("q8")
    with pytest.raises(ConfigError, match="unknown moment format"):
        quantization_bound("int4")
    with pytest.raises(ConfigError, match="unknown moment format"):
        quantization_error_bound("q8", torch.zeros(3))
    assert torch.isinf(quantization_error_bound("bf16", torch.tensor([float("nan"), 3e38]))).all()


def test_adambridge_is_named_with_the_way_its_state_moves():
    """The torch interop refused AdamBridge as "not a MemOptimizer or Flash*" (ApexW, accepted,
    went unnamed), and AdamBridge's own refusal of a torch state dict pointed at a
    memopt_checkpoint conversion that does not exist for it."""
    offload = pytest.importorskip("memopt_offload")
    p = torch.nn.Parameter(torch.zeros(32, dtype=torch.bfloat16))
    bridge = offload.AdamBridge([p], pin_memory=False)
    with pytest.raises(TypeError, match=r"memopt_apexw\.ApexW\), got AdamBridge: .* no converter"):
        to_torch_state_dict(bridge)
    q = torch.nn.Parameter(torch.zeros(32))
    adamw = torch.optim.AdamW([q])
    q.grad = torch.ones(32)
    adamw.step()
    with pytest.raises(StateDictError, match=r"not saved by AdamBridge \(no converter makes one"):
        offload.AdamBridge([torch.nn.Parameter(torch.zeros(32))], pin_memory=False).load_state_dict(
            adamw.state_dict()
        )


def test_sharded_parameters_are_refused_up_front(monkeypatch):
    """FSDP2-sharded (DTensor) parameters: the conversions work on whole tensors and failed deep
    inside (a local shard reshaped to the global shape, a plain tensor copied into a DTensor;
    found with 2 gloo ranks). Refused first, naming the parameter and what to use instead."""
    from memopt_checkpoint import interop

    model = nn.Linear(4, 3)
    opt = MemOptimizer(model.parameters(), rule="adamw", moments="q8")
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch_sd = torch.optim.AdamW(nn.Linear(4, 3).parameters()).state_dict()
    monkeypatch.setattr(interop, "is_dtensor", lambda t: t is model.bias)
    match = r"parameter 1 of param group 0 is sharded .* torch.distributed.checkpoint"
    with pytest.raises(ConfigError, match="to_torch_state_dict converts whole tensors; " + match):
        to_torch_state_dict(opt)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ConfigError, match="load_torch_state_dict converts whole tensors; " + match):
        load_torch_state_dict(opt, torch_sd)
    after = opt.state_dict()
    assert all(torch.equal(before["state"][1][k], after["state"][1][k]) for k in after["state"][1])


@pytest.mark.parametrize("moments", ["q8", "fp8"])
def test_export_after_an_edited_count_converts_first(moments):
    """A step count edited by hand before the export (``state[p]["step"].zero_()``): the
    export converts the stored ``u`` to the new count first, as the next step would, and
    hands out the ``v`` the optimizer holds (read against the new count's ``N``, it was
    ``0.95**-60`` = 22x larger); so does a written entry's ``decay_norm_step``."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(40))
    opt = MemOptimizer([p], lr=1e-3, betas=(0.9, 0.95), moments=moments)
    for _ in range(60):
        p.grad = torch.randn(40)
        opt.step()
    before = to_torch_state_dict(opt)["state"][0]["exp_avg_sq"]
    written = copy.deepcopy(opt.state_dict()["state"][0])
    opt.state[p]["step"].zero_()
    after = to_torch_state_dict(opt)["state"][0]
    assert int(after["step"]) == 0
    assert 0.9 < (after["exp_avg_sq"] / before).mean().item() < 1.1
    # a state dict entry written into optimizer.state (ZeroRedundancyOptimizer's load writes
    # them), its count edited: read for the count its record says until the next step adopts it
    written["step"] = torch.tensor(5.0)
    opt.state[p] = written
    assert torch.equal(to_torch_state_dict(opt)["state"][0]["exp_avg_sq"], before)
