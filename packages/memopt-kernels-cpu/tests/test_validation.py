"""Bad input to every public function: a clear ConfigError / FormatError naming the argument,
raised before any kernel runs; and what the Python layer hands to C++ (slot table, ids, scalars,
addresses), recorded by a stand-in for ``_core.fused_step`` so no test depends on kernel results.
Meta tensors stand in for any non-CPU device."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools

import pytest
import torch

from memopt_core import rng
from memopt_core.errors import ConfigError, FormatError
from memopt_core.formats import StateSpec
from memopt_core.plan import GroupPlan, StateArena
from memopt_core.reference import lion_scalars
from memopt_core.testing import bits
from memopt_kernels_cpu import _core
from memopt_kernels_cpu.ops import SLOT_COLUMNS

META = "meta"


# ----------------------------------------------------------------------------------- helpers
def read_table(addr: int, n: int) -> torch.Tensor:
    width = len(SLOT_COLUMNS)
    buf = (ctypes.c_int64 * (width * n)).from_address(addr)
    return torch.tensor(list(buf), dtype=torch.int64).view(n, width)


@pytest.fixture
def recorder(monkeypatch):
    """Replaces ``_core.fused_step``; ``calls`` holds (slot table rows, keyword arguments)."""
    calls: list[tuple[torch.Tensor, dict]] = []

    def fake(slot_table, n_slots, **kw):
        calls.append((read_table(slot_table, n_slots) if n_slots else None, kw))

    monkeypatch.setattr(_core, "fused_step", fake)
    return calls


def f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


# ----------------------------------------------------------------------------------- encode_moment
def test_encode_moment_errors(ops):
    x = torch.randn(64)
    with pytest.raises(ConfigError, match=r"unknown moment format 'fp16'"):
        ops.encode_moment("fp16", x)
    with pytest.raises(FormatError, match=r"x must be float32, got torch.float64"):
        ops.encode_moment("fp32", x.double())
    with pytest.raises(ConfigError, match=r"x is on meta"):
        ops.encode_moment("fp32", torch.empty(64, device=META))
    with pytest.raises(ConfigError, match=r"x must be a torch.Tensor, got list"):
        ops.encode_moment("fp32", [1.0, 2.0])
    with pytest.raises(ConfigError, match=r"x is a torch.sparse_coo tensor"):
        ops.encode_moment("fp32", x.to_sparse())
    with pytest.raises(FormatError, match=r"whole blocks of 32 elements; got a length of 33"):
        ops.encode_moment("q8_signed", torch.randn(33))
    with pytest.raises(FormatError, match=r"rand must be an int64 tensor of 64 uniform"):
        ops.encode_moment("bf16", x, rand=torch.zeros(63, dtype=torch.int64))
    with pytest.raises(FormatError, match=r"rand must be an int64 .* got torch.int32\(64,\)"):
        ops.encode_moment("bf16", x, rand=torch.zeros(64, dtype=torch.int32))
    with pytest.raises(ConfigError, match=r"rand is on meta"):
        ops.encode_moment("bf16", x, rand=torch.zeros(64, dtype=torch.int64, device=META))


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),
        ("fp8_e4m3", torch.float8_e4m3fn),
        ("fp8_e5m2", torch.float8_e5m2),
        ("q8_signed", torch.float8_e4m3fn),  # the fp8_e4m3 layout
        ("q8_sqrt", torch.uint8),
    ],
)
def test_moment_codecs_shapes_and_strided_input(ops, fmt, dtype):
    x = torch.randn(8, 64).t()  # (64, 8), not contiguous: copied, never an error
    rand = torch.randint(0, 2**32, (512,), dtype=torch.int64)
    fields = ops.encode_moment(fmt, x, rand=rand)
    assert fields[""].dtype == dtype
    assert fields[""].shape == (64, 8)
    blocked = fmt not in ("fp32", "bf16")
    assert set(fields) == ({"", "scale"} if blocked else {""})
    if blocked:
        assert fields["scale"].dtype == torch.uint8
        assert fields["scale"].shape == (16,)
    out = ops.decode_moment(fmt, {k: v.clone() for k, v in fields.items()})
    assert out.dtype == torch.float32
    assert out.shape == (64, 8)
    assert ops.encode_moment(fmt, torch.empty(0))[""].numel() == 0


def test_decode_moment_errors(ops):
    codes = torch.zeros(64, dtype=torch.uint8)
    scale = torch.zeros(2, dtype=torch.uint8)
    with pytest.raises(FormatError, match=r"fields must be a mapping"):
        ops.decode_moment("q8_sqrt", [codes, scale])
    with pytest.raises(FormatError, match=r"missing \['scale'\]"):
        ops.decode_moment("q8_sqrt", {"": codes})
    with pytest.raises(FormatError, match=r"field '' of 'q8_sqrt' must be torch.uint8"):
        ops.decode_moment("q8_sqrt", {"": codes.to(torch.int8), "scale": scale})
    with pytest.raises(FormatError, match=r"64 codes need 2 scales .* got 3"):
        ops.decode_moment("q8_sqrt", {"": codes, "scale": torch.zeros(3, dtype=torch.uint8)})
    with pytest.raises(FormatError, match=r"whole blocks of 32"):
        ops.decode_moment(
            "fp8_e4m3",
            {"": torch.zeros(40, dtype=torch.float8_e4m3fn), "scale": scale},
        )
    with pytest.raises(ConfigError, match=r"field '' of 'fp32' is on meta"):
        ops.decode_moment("fp32", {"": torch.empty(4, device=META)})
    with pytest.raises(ConfigError, match=r"field 'scale' of 'q8_sqrt' is on meta"):
        ops.decode_moment(
            "q8_sqrt", {"": codes, "scale": torch.empty(2, dtype=torch.uint8, device=META)}
        )
    with pytest.raises(ConfigError, match=r"unknown moment format"):
        ops.decode_moment("int4", {"": codes})


# ----------------------------------------------------------------------------------- masters
def test_encode_master_errors(ops):
    x = torch.randn(10)
    with pytest.raises(ConfigError, match=r"unknown master format 'ecc16'"):
        ops.encode_master("ecc16", x)
    with pytest.raises(ConfigError, match=r"got torch.float16 parameters"):
        ops.encode_master("ecc24", x, torch.float16)
    with pytest.raises(ConfigError, match=r"master format 'fp32' updates float32 parameters"):
        ops.encode_master("fp32", x, torch.bfloat16)
    with pytest.raises(FormatError, match=r"x must be float32, got torch.bfloat16"):
        ops.encode_master("ecc32", x.bfloat16())
    with pytest.raises(ConfigError, match=r"x is on meta"):
        ops.encode_master("ecc32", torch.empty(10, device=META))
    with pytest.raises(FormatError, match=r"rand must be an int64 tensor of 10"):
        ops.encode_master("ecc24", x, rand=torch.zeros(11, dtype=torch.int64))


@pytest.mark.parametrize(
    ("fmt", "pdtype", "cdtype"),
    [
        ("fp32", torch.float32, None),
        ("none", torch.bfloat16, None),
        ("none", torch.float16, None),
        ("ecc24", torch.bfloat16, torch.uint8),
        ("ecc32", torch.bfloat16, torch.int16),
    ],
)
def test_master_codecs_shapes(ops, fmt, pdtype, cdtype):
    x = torch.randn(5, 7)
    param, code = ops.encode_master(fmt, x, pdtype, rand=torch.zeros(35, dtype=torch.int64))
    assert param.dtype == pdtype
    assert param.shape == (5, 7)
    assert (code is None) == (cdtype is None)
    if code is not None:
        assert code.dtype == cdtype
        assert code.shape == (5, 7)
    out = ops.decode_master(fmt, param.t(), None if code is None else code.t())
    assert out.dtype == torch.float32
    assert out.shape == (7, 5)


def test_decode_master_errors(ops):
    p = torch.zeros(6, dtype=torch.bfloat16)
    with pytest.raises(FormatError, match=r"decodes a parameter together with its code; got None"):
        ops.decode_master("ecc24", p)
    with pytest.raises(FormatError, match=r"needs a torch.int16 code of 6 entries .* torch.uint8"):
        ops.decode_master("ecc32", p, torch.zeros(6, dtype=torch.uint8))
    with pytest.raises(
        FormatError, match=r"needs a torch.uint8 code of 6 .* got code torch.uint8\(5,\)"
    ):
        ops.decode_master("ecc24", p, torch.zeros(5, dtype=torch.uint8))
    with pytest.raises(ConfigError, match=r"param is on meta"):
        ops.decode_master("ecc24", torch.empty(6, dtype=torch.bfloat16, device=META))
    with pytest.raises(ConfigError, match=r"code is on meta"):
        ops.decode_master("ecc24", p, torch.empty(6, dtype=torch.uint8, device=META))
    with pytest.raises(ConfigError, match=r"got torch.float32 parameters"):
        ops.decode_master("ecc24", p.float(), torch.zeros(6, dtype=torch.uint8))
    with pytest.raises(ConfigError, match=r"param must be a torch.Tensor, got NoneType"):
        ops.decode_master("fp32", None)
    for fmt, dtype in (("fp32", torch.float32), ("none", torch.bfloat16)):  # was ignored
        with pytest.raises(FormatError, match=rf"'{fmt}' has no code; got a torch.uint8 tensor"):
            ops.decode_master(fmt, torch.zeros(6, dtype=dtype), torch.zeros(6, dtype=torch.uint8))


# ----------------------------------------------------------------------------------- words
def test_stream_words_errors_and_shape(ops):
    with pytest.raises(FormatError, match=r"index must be an integer tensor, got torch.float32"):
        ops.stream_words(1, 2, torch.zeros(3), 1)
    with pytest.raises(FormatError, match=r"got torch.bool"):
        ops.stream_words(1, 2, torch.zeros(3, dtype=torch.bool), 1)
    with pytest.raises(ConfigError, match=r"index is on meta"):
        ops.stream_words(1, 2, torch.zeros(3, dtype=torch.int64, device=META), 1)
    with pytest.raises(ConfigError, match=r"seed must be an int, got float"):
        ops.stream_words(1.0, 2, torch.zeros(3, dtype=torch.int64), 1)
    with pytest.raises(ConfigError, match=r"step must be an int, got bool"):
        ops.stream_words(1, 2, torch.zeros(3, dtype=torch.int64), True)
    words = ops.stream_words(2**40 + 5, -1, torch.arange(12, dtype=torch.int32).view(3, 4), 2**33)
    assert len(words) == 3
    for w in words:
        assert w.dtype == torch.int64
        assert w.shape == (3, 4)
        assert bool(((w >= 0) & (w < 2**32)).all())
    # ids and steps count modulo 2**32, as in the reference
    want = rng.stream_words(2**40 + 5, -1, torch.arange(12).view(3, 4), 2**33)
    assert all(torch.equal(w, v) for w, v in zip(words, want, strict=True))
    assert all(w.numel() == 0 for w in ops.stream_words(0, 0, torch.empty(0, dtype=torch.int64), 0))

    # a negated view's memory holds the opposite values: the words are those of its values
    neg = torch._neg_view(-torch.arange(5, dtype=torch.int64))
    want = rng.stream_words(3, 4, torch.arange(5), 6)
    assert all(torch.equal(w, v) for w, v in zip(ops.stream_words(3, 4, neg, 6), want, strict=True))


def test_stream_words_take_any_integral_id(ops):
    """numpy integers are accepted as ints (as by the steps and by memopt-kernels-triton)."""
    np = pytest.importorskip("numpy")
    idx = torch.arange(40, dtype=torch.int64)
    want = ops.stream_words(7, 3, idx, 2**31 + 9)
    got = ops.stream_words(np.int64(7), np.uint32(3), idx, np.uint64(2**31 + 9))
    assert all(torch.equal(w, v) for w, v in zip(got, want, strict=True))


# ----------------------------------------------------------------------------------- raw _core
def test_core_standalone_checks_its_arguments(core):
    x = torch.zeros(64)
    c = torch.zeros(64, dtype=torch.uint8)
    s = torch.zeros(2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"fmt must be in \[0, 4\], got 5"):
        core.encode_moment(5, x.data_ptr(), 64, c.data_ptr(), s.data_ptr(), 0)
    with pytest.raises(ValueError, match=r"n % 32 == 0, got n = 33"):
        core.encode_moment(2, x.data_ptr(), 33, c.data_ptr(), s.data_ptr(), 0)
    with pytest.raises(ValueError, match=r"scales is required here"):
        core.encode_moment(4, x.data_ptr(), 64, c.data_ptr(), 0, 0)
    with pytest.raises(ValueError, match=r"x is required here"):
        core.encode_moment(0, 0, 64, c.data_ptr(), 0, 0)
    with pytest.raises(ValueError, match=r"negative address"):
        core.decode_moment(0, -8, 0, 64, x.data_ptr())
    with pytest.raises(ValueError, match=r"n must be >= 0"):
        core.decode_moment(0, c.data_ptr(), 0, -1, x.data_ptr())
    with pytest.raises(ValueError, match=r"master must be in \[0, 4\], got 9"):
        core.encode_master(9, x.data_ptr(), 64, c.data_ptr(), 0, 0)
    with pytest.raises(ValueError, match=r"code is required here"):
        core.decode_master(3, c.data_ptr(), 0, 64, x.data_ptr())
    with pytest.raises(ValueError, match=r"index is required here"):
        core.stream_words(1, 2, 3, 0, 4, x.data_ptr())
    core.encode_moment(0, 0, 0, 0, 0, 0)  # nothing to do: no address needed


# ----------------------------------------------------------------------------------- fused step
def test_fused_step_argument_errors(ops, make_work, recorder):
    def fails(exc, pattern, **changes):
        work = make_work()
        for k, v in changes.items():
            setattr(work, k, v)
        with pytest.raises(exc, match=pattern):
            ops.fused_step(work)

    base = make_work()
    p, g = base.params, base.grads
    fails(
        ConfigError,
        r"parameter 0 \(slot 0, shape \(33,\), torch.float32\): the group holds torch.bfloat16",
        params=[p[0].float(), *p[1:]],
    )
    fails(
        ConfigError,
        r"parameter 2 \(slot 2, shape \(2,\), torch.bfloat16\) has 2 elements but the plan's "
        r"slot 2 has 1",
        params=[*p[:2], torch.zeros(2, dtype=torch.bfloat16), *p[3:]],
    )
    fails(
        ConfigError,
        r"the gradient of parameter 1 \(slot 1, shape \(16, 4\), torch.bfloat16\) is "
        r"torch.float16; gradients have the parameter's dtype or float32",
        grads=[g[0], g[1].half(), *g[2:]],
    )
    fails(
        ConfigError,
        r"the gradient of parameter 1 .* has shape \(64,\); it must match",
        grads=[g[0], g[1].reshape(-1), *g[2:]],
    )
    fails(
        ConfigError,
        r"the gradient of parameter 0 \(slot 0, shape \(33,\), torch.bfloat16\) is on meta",
        grads=[torch.empty(33, dtype=torch.bfloat16, device=META), *g[1:]],
    )
    fails(
        ConfigError,
        r"parameter 4 \(slot 4\) is on meta",
        params=[*p[:4], torch.empty(100, dtype=torch.bfloat16, device=META)],
    )
    fails(
        ConfigError,
        r"the gradient of parameter 0 .* is a torch.sparse_coo tensor",
        grads=[g[0].to_sparse(), *g[1:]],
    )
    fails(
        ConfigError,
        r"parameter 3 \(slot 3\) must be a torch.Tensor, got int",
        params=[*p[:3], 5, p[4]],
    )
    fails(ConfigError, "a step of 5 slots got 4 parameters", params=p[:4])
    fails(ConfigError, "slots must be ascending, distinct", slots=[0, 2, 1, 3, 4])
    fails(ConfigError, "slots must be ascending, distinct", slots=[0, 1, 2, 3, 9])
    fails(ConfigError, "the cpu backend runs rules", rule="adagrad")
    fails(
        ConfigError,
        r"work.scalars \(LionScalars\) lacks 'eps'",
        scalars=lion_scalars(lr=1.0, betas=(0.9, 0.99)),
    )
    fails(ConfigError, "tensor id of parameter 0 .* must be an int", tensor_ids=[1.5, 2, 3, 4, 5])
    assert recorder == []  # nothing reached C++


def test_fused_step_group_errors(ops, make_work, recorder):
    spec = StateSpec(master="none", moments="fp32")
    work = make_work()
    meta = [torch.empty(3, dtype=torch.bfloat16, device=META)]
    work.plan = GroupPlan(meta, spec)
    with pytest.raises(ConfigError, match=r"the group .* is on meta"):
        ops.fused_step(work)
    dbl = [torch.zeros(3, dtype=torch.float64)]
    work.plan = GroupPlan(dbl, StateSpec(master="fp32", moments="fp32"))
    with pytest.raises(
        ConfigError, match=r"float32, bfloat16 or float16 parameters, got torch.float64"
    ):
        ops.fused_step(work)
    assert recorder == []


def test_aliasing_is_refused(ops, make_work, recorder):
    work = make_work("sgd", "fp32", "fp32", torch.float32, sizes=(40, 40), momentum=0.9)
    p0 = work.params[0]
    work.grads = [p0, work.grads[1]]  # the gradient is the parameter itself: allowed (read first)
    ops.fused_step(work)
    shifted = torch.zeros(41)
    work.params = [shifted[:40].view(p0.shape), work.params[1]]
    work.grads = [shifted[1:].view(p0.shape), work.grads[1]]  # a shifted view of its parameter
    with pytest.raises(
        ConfigError, match=r"parameter 0 .* and the gradient of parameter 0 .* share memory"
    ):
        ops.fused_step(work)
    assert len(recorder) == 1
    recorder.clear()

    work = make_work("sgd", "fp32", "fp32", torch.float32, sizes=(40, 40), momentum=0.9)
    work.grads = [work.grads[0], work.params[0].view(-1)[:40].view(work.params[1].shape)]
    with pytest.raises(ConfigError, match=r"share memory"):  # a gradient reads another parameter
        ops.fused_step(work)
    # a strided view was checked through its contiguous copy, and accepted (Triton refuses it)
    pair = torch.zeros(80)
    work.params = [pair.view(40, 2)[:, 0], work.params[1]]  # shapes (40,) and (10, 4)
    work.grads = [work.grads[0], pair.view(10, 4, 2)[..., 0]]  # the same elements
    with pytest.raises(
        ConfigError, match=r"parameter 0 .* and the gradient of parameter 1 .* share"
    ):
        ops.fused_step(work)

    buf = torch.zeros(80)
    spec = StateSpec(master="fp32", moments="fp32")
    overlapping = [buf[0:40], buf[32:72]]
    w = make_work("sgd", "fp32", "fp32", torch.float32, sizes=(40, 40))
    w.plan = GroupPlan(overlapping, spec)
    w.arena = StateArena(w.plan, {}, spec.master_for(torch.float32))
    w.params = overlapping
    w.grads = [torch.zeros(40), torch.zeros(40)]
    with pytest.raises(ConfigError, match=r"parameter 0 .* and parameter 1 .* share memory"):
        ops.fused_step(w)
    assert recorder == []

    # views of one buffer that do not overlap are fine, strided and interleaved ones too
    for views in ([buf[0:40], buf[40:80]], [buf.view(40, 2)[:, 0], buf.view(40, 2)[:, 1]]):
        w.plan = GroupPlan(views, spec)
        w.arena = StateArena(w.plan, {}, spec.master_for(torch.float32))
        w.params = list(views)
        ops.fused_step(w)
    assert len(recorder) == 2


def test_staging_errors(ops, make_work, recorder):
    work = make_work(sizes=(33, 64))
    good = [torch.empty(33, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16)]
    cases = [
        (
            [good[0].float(), good[1]],
            r"staging of parameter 0 .* must be a contiguous bfloat16 tensor of 33 elements, got torch.float32",
        ),
        (
            [good[0], torch.empty(63, dtype=torch.bfloat16)],
            r"staging of parameter 1 .* of 64 elements, got torch.bfloat16\(63,\)",
        ),
        ([good[0], torch.empty(8, 8, dtype=torch.bfloat16).t()], r"\(not contiguous\)"),
        (
            [good[0], torch.empty(64, dtype=torch.bfloat16, device=META)],
            r"staging of parameter 1 .* is on meta",
        ),
        (
            [good[0], work.params[1].view(-1)],
            r"parameter 1 .* and staging of parameter 1 .* share memory|staging of parameter 1 .* and parameter 1 .* share memory",
        ),
        ([good[0]], "staging holds 1 entries for the 2 parameters"),
        ({0: good[0], 5: good[1]}, r"staging has entries for slots \[5\]"),
        (7, "staging must be None, a {slot: tensor} mapping or a sequence, got int"),
    ]
    for staging, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            ops.fused_step(work, staging=staging)
    half = make_work("adamw", "none", "fp32", torch.float16, sizes=(8,))
    with pytest.raises(ConfigError, match=r"float16 parameters have none"):
        ops.fused_step(half, staging=[torch.empty(8, dtype=torch.bfloat16)])
    assert recorder == []


def test_arena_errors(ops, make_work, recorder):
    def broken(fn):
        work = make_work()
        fn(work.arena)
        return work

    cases = [
        (
            lambda a: a.fields["exp_avg_sq"].__setitem__(
                "", a.fields["exp_avg_sq"][""].to(torch.int8)
            ),
            FormatError,
            r"the arena's exp_avg_sq\[''\] must be a contiguous torch.uint8 tensor of 288 entries .* got torch.int8",
        ),
        (
            lambda a: a.fields["exp_avg"].__setitem__("scale", torch.zeros(7, dtype=torch.uint8)),
            FormatError,
            r"the arena's exp_avg\['scale'\] must be a contiguous torch.uint8 tensor of 9 entries",
        ),
        (
            lambda a: a.fields["exp_avg"].__setitem__(
                "", torch.zeros(16, 18, dtype=torch.uint8).t()
            ),
            FormatError,
            r"\(not contiguous\)",
        ),
        (
            lambda a: a.fields["exp_avg"].__setitem__(
                "", torch.zeros(288, dtype=torch.uint8, device=META)
            ),
            ConfigError,
            r"the arena's exp_avg\[''\] is on meta",
        ),
        (lambda a: a.codecs.pop("exp_avg_sq"), FormatError, "has no 'exp_avg_sq' state"),
        (lambda a: a.fields["exp_avg"].pop("scale"), FormatError, r"exp_avg\['scale'\] is missing"),
        (
            lambda a: setattr(a, "master_code", None),
            FormatError,
            "master format 'ecc24' keeps a code per element but the arena has no master_code",
        ),
        (
            lambda a: setattr(a, "master_code", torch.zeros(288, dtype=torch.int16)),
            FormatError,
            "the arena's master_code must be a contiguous torch.uint8 tensor of 288 entries",
        ),
    ]
    for fn, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            ops.fused_step(broken(fn))
    assert recorder == []


# ----------------------------------------------------------------------------------- plumbing
def test_slot_table_columns(ops, make_work, recorder):
    assert ops.SLOT_COLUMNS == (
        "param", "grad", "grad_kind", "tensor_id", "numel", "padded", "arena_offset", "staging",
        "index_base",
    )  # fmt: skip
    assert _core.SLOT_ROW_WORDS == 9
    work = make_work(sizes=(33, 64, 1, 0, 100), grad_dtype=torch.float32)
    work.tensor_ids = [2**32 + 5, 7, 2**33 - 1, 0, 12]
    ops.fused_step(work)
    ((table, kw),) = recorder
    assert table.shape == (5, 9)
    for row, si, p, g, tid in zip(
        table.tolist(), work.slots, work.params, work.grads, work.tensor_ids, strict=True
    ):
        slot = work.plan.slots[si]
        assert row == [
            p.data_ptr(),
            g.data_ptr(),
            0,
            tid & 0xFFFFFFFF,
            slot.numel,
            slot.padded,
            slot.offset,
            0,
            0,
        ]
    assert [r[5] for r in table.tolist()] == [64, 64, 32, 0, 128]
    assert [r[6] for r in table.tolist()] == [0, 64, 128, 160, 160]
    assert kw["arena_elements"] == work.plan.total == 288


def test_index_base_column(ops, make_work, recorder):
    work = make_work(sizes=(33, 64, 1, 0, 100))
    work.index_bases = [7, 2**33 + 1, 0, 2**62 - 1, 2**62 - 129]  # the largest bases allowed
    ops.fused_step(work)
    assert recorder[0][0][:, 8].tolist() == work.index_bases
    work.index_bases = None  # none: every base 0
    ops.fused_step(work)
    assert recorder[1][0][:, 8].tolist() == [0] * 5


def test_index_bases_errors(ops, make_work, recorder):
    def fails(pattern, bases):
        work = make_work(sizes=(33, 64))
        work.index_bases = bases
        with pytest.raises(ConfigError, match=pattern):
            ops.fused_step(work)

    label = r"parameter 1 \(slot 1, shape \(16, 4\), torch.bfloat16\)"
    fails(rf"index base of {label} must be >= 0 .*, got -1", [0, -1])
    fails(rf"index base of {label} must be an int, got bool", [0, False])
    fails(rf"index base of {label} must be an int, got float", [0, 32.0])
    fails(rf"index base of {label} must be an int, got list", [0, [1]])
    fails(rf"index base of {label} is {2**62 - 64}: with its 64 padded elements", [0, 2**62 - 64])
    fails(r"index_bases must be None or hold one .* \(2\), got 3 entries", [0, 0, 0])
    fails(r"index_bases must be None or hold one .* \(2\), got int", 5)
    assert recorder == []


def test_numpy_integers_as_tensor_ids_and_index_bases(ops, make_work, recorder):
    """The torch backend takes them; the cpu backend refused them ("must be an int")."""
    np = pytest.importorskip("numpy")
    work = make_work(sizes=(33, 64))
    work.tensor_ids = [np.int64(2**32 + 7), np.uint32(9)]
    work.index_bases = [np.int64(5), np.int32(64)]
    ops.fused_step(work)
    ((table, _),) = recorder
    assert table[:, 3].tolist() == [7, 9]  # the low 32 bits
    assert table[:, 8].tolist() == [5, 64]


def test_partial_step_rows(ops, make_work, recorder):
    work = make_work(sizes=(33, 64, 1, 100), slots=[1, 3])
    work.index_bases = [11, 2**40]
    ops.fused_step(work)
    ((table, _),) = recorder
    assert table[:, 4].tolist() == [64, 100]
    assert table[:, 8].tolist() == [11, 2**40]
    assert table[:, 6].tolist() == [work.plan.slots[1].offset, work.plan.slots[3].offset]
    assert table[:, 0].tolist() == [work.params[0].data_ptr(), work.params[1].data_ptr()]


RULES = [
    ("adamw", dict(weight_decay=0.1)),
    ("adam", dict(weight_decay=0.05, maximize=True, betas=(0.8, 0.99))),
    ("sgd", dict()),
    ("sgd", dict(momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False)),
    ("sgd", dict(momentum=0.9, nesterov=True)),
    ("sgdw", dict(momentum=0.8, weight_decay=0.1, maximize=True)),
    ("lion", dict(weight_decay=0.1)),
]
MASTERS = [
    ("fp32", torch.float32, 0),
    ("none", torch.bfloat16, 1),
    ("none", torch.float16, 2),
    ("ecc24", torch.bfloat16, 3),
    ("ecc32", torch.bfloat16, 4),
]
PRESETS = {"fp32": (0, 0), "bf16": (1, 1), "fp8": (2, 3), "q8": (2, 4)}


@pytest.mark.parametrize(
    ("rule", "hyper"), RULES, ids=[f"{r}{i}" for i, (r, _) in enumerate(RULES)]
)
@pytest.mark.parametrize(
    ("master", "dtype", "mid"), MASTERS, ids=[f"{m}-{str(d)[6:]}" for m, d, _ in MASTERS]
)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_ids_addresses_and_flags(ops, make_work, recorder, rule, hyper, master, dtype, mid, preset):
    work = make_work(rule, master, preset, dtype, step=3, sr=preset != "fp32", **hyper)
    ops.fused_step(work)
    ((_, kw),) = recorder
    kind = work.rule
    f1, f2 = PRESETS[preset]
    has_m = kind != "sgd" or hyper.get("momentum", 0.0) != 0.0
    assert kw["rule"] == {"sgd": 0, "adam": 1, "lion": 2}[kind]
    assert kw["master"] == mid
    assert kw["fmt1"] == (f1 if has_m else 5)
    assert kw["fmt2"] == (f2 if kind == "adam" else 5)
    assert kw["block"] == work.plan.block_size == (32 if preset in ("fp8", "q8") else 1)
    assert kw["sr"] is (preset != "fp32")
    arena = work.arena
    first = {"adam": "exp_avg", "lion": "exp_avg", "sgd": "momentum_buffer"}[kind]
    m = arena.fields[first] if has_m else {}
    v = arena.fields["exp_avg_sq"] if kind == "adam" else {}
    assert kw["m"] == (m[""].data_ptr() if m else 0)
    assert kw["ms"] == (m["scale"].data_ptr() if "scale" in m else 0)
    assert kw["v"] == (v[""].data_ptr() if v else 0)
    assert kw["vs"] == (v["scale"].data_ptr() if "scale" in v else 0)
    code = arena.master_code
    assert kw["code"] == (code.data_ptr() if code is not None else 0)
    assert (code is not None) == (master in ("ecc24", "ecc32"))
    s = work.scalars
    assert kw["maximize"] is bool(hyper.get("maximize", False))
    assert kw["has_decay"] is (s.decay != 1.0)
    assert kw["has_l2"] is (kind != "lion" and s.l2 != 0.0)
    assert kw["has_momentum"] is (kind == "sgd" and has_m)
    assert kw["nesterov"] is bool(hyper.get("nesterov", False))
    assert kw["first_step"] is False
    assert kw["seed"] == 1234
    assert kw["step"] == 3


def test_scalars_order_and_rounding(ops, make_work, recorder):
    adam = make_work(
        "adam",
        "fp32",
        "fp32",
        torch.float32,
        lr=0.1,
        betas=(0.7, 0.3),
        eps=1e-3,
        weight_decay=0.2,
        step=2,
    )
    sgd = make_work(
        "sgdw", "fp32", "fp32", torch.float32, lr=0.3, momentum=0.6, dampening=0.1, weight_decay=0.7
    )
    lion = make_work(
        "lion", "fp32", "fp32", torch.float32, lr=0.3, betas=(0.6, 0.9), weight_decay=0.1
    )
    for w in (adam, sgd, lion):
        ops.fused_step(w)
    a, s, li = adam.scalars, sgd.scalars, lion.scalars
    want = [
        [
            a.one_minus_beta1,
            a.beta2,
            a.one_minus_beta2,
            a.eps,
            a.step_size,
            a.bc2_sqrt,
            a.decay,
            a.l2,
        ],
        [s.lr, s.momentum, s.one_minus_dampening, 0, 0, 0, s.decay, s.l2],
        [li.lr, li.beta1, li.one_minus_beta1, li.beta2, li.one_minus_beta2, 0, li.decay, 0],
    ]
    for (_, kw), values in zip(recorder, want, strict=True):
        assert kw["scalars"] == [f32(v) for v in values]
    assert recorder[0][1]["has_l2"]
    assert not recorder[0][1]["has_decay"]
    assert recorder[1][1]["has_decay"]
    assert not recorder[1][1]["has_l2"]
    assert f32(0.1) != 0.1  # the values really were rounded to float32


def test_seed_step_and_first_step(ops, make_work, recorder):
    work = make_work(seed=2**32 + 7, step=2**32 + 3)
    ops.fused_step(work)
    first = make_work(step=1)
    ops.fused_step(first)
    assert recorder[0][1]["seed"] == 7
    assert recorder[0][1]["step"] == 3
    assert recorder[0][1]["first_step"] is False
    assert recorder[1][1]["first_step"] is True


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [("seed", 1.5, "float"), ("step", 2.0, "float"), ("step", True, "bool")],
)
def test_seed_and_step_must_be_ints(ops, make_work, recorder, field, value, shown):
    """A float is refused, not truncated (2.5 would have run step 2's scalars with step 2's
    rounding words); the prepared launch checks the same way."""
    work = dataclasses.replace(make_work(), **{field: value})
    with pytest.raises(ConfigError, match=rf"{field} must be an int, got {shown}"):
        ops.fused_step(work)
    prepared = ops.prepare_step(make_work())
    args = {"seed": 0, "step": 1, field: value}
    with pytest.raises(ConfigError, match=rf"{field} must be an int, got {shown}"):
        prepared.launch(work.scalars, args["step"], args["seed"], False)
    assert recorder == []


def test_staging_addresses(ops, make_work, recorder):
    work = make_work(sizes=(33, 64, 1))
    st = [torch.empty(n, dtype=torch.bfloat16) for n in (33, 64, 1)]
    ops.fused_step(work, staging={1: st[1]})
    ops.fused_step(work, staging=[st[0], None, st[2]])
    assert recorder[0][0][:, 7].tolist() == [0, st[1].data_ptr(), 0]
    assert recorder[1][0][:, 7].tolist() == [st[0].data_ptr(), 0, st[2].data_ptr()]


def test_tables_are_cached_and_revalidated_on_change(ops, make_work, recorder, monkeypatch):
    prepared = []
    real = ops._prepare
    monkeypatch.setattr(ops, "_prepare", lambda *a: prepared.append(1) or real(*a))
    work = make_work()
    ops.fused_step(work)
    ops.fused_step(work)
    assert len(prepared) == 1  # the second step reused the validated table
    work.grads = [g.clone() for g in work.grads]  # new addresses: validate again
    ops.fused_step(work)
    assert len(prepared) == 2
    work.grads = [work.grads[0].float(), *work.grads[1:]]
    ops.fused_step(work)
    assert len(prepared) == 3
    assert recorder[3][0][0, 2] == 0
    assert recorder[2][0][0, 2] == 1
    work.index_bases = [0, 32, 0, 0, 0]  # other bases: another table
    ops.fused_step(work)
    assert len(prepared) == 4
    assert recorder[4][0][:, 8].tolist() == [0, 32, 0, 0, 0]
    ops.fused_step(work)
    assert len(prepared) == 4
    work.index_bases = [0, 32.0, 0, 0, 0]  # equal to a cached key, but refused: validated again
    with pytest.raises(ConfigError, match=r"index base of parameter 1 .* must be an int"):
        ops.fused_step(work)


def test_cached_tables_do_not_stand_in_for_smaller_tensors(ops, make_work, recorder):
    """A tensor at a cached address but smaller, of another dtype, or a step with other
    rounding is validated again (a hit keyed on addresses alone let the kernel write past a
    1-element staging tensor or parameter)."""
    work = make_work("adamw", "fp32", "bf16", torch.float32, sizes=(256,))
    big = torch.zeros(512, dtype=torch.bfloat16)
    ops.fused_step(work, staging=[big[:256]])
    with pytest.raises(
        ConfigError, match=r"staging of parameter 0 .*256 elements, got torch.bfloat16\(1,\)"
    ):
        ops.fused_step(work, staging=[big[:1]])
    with pytest.raises(ConfigError, match=r"staging of parameter 0 .*got torch.int16"):
        ops.fused_step(work, staging=[big[:256].view(torch.int16)])
    param = work.params[0]
    ops.fused_step(work)
    work.params = [param.view(-1)[:1]]
    with pytest.raises(
        ConfigError,
        match=r"parameter 0 \(slot 0, shape \(1,\).* has 1 elements but the plan's slot 0 has 256",
    ):
        ops.fused_step(work)
    work.params = [param]
    rne = make_work("adamw", "fp32", "bf16", torch.float32, sizes=(256,), sr=False)
    ops.fused_step(dataclasses.replace(work, spec=rne.spec))
    assert [kw["sr"] for _, kw in recorder] == [True, True, False]  # the refused calls ran nothing
    # a strided staging tensor at the cached address, dtype and size (the kernel would write
    # it as if packed)
    with pytest.raises(ConfigError, match=r"staging of parameter 0 .*contiguous"):
        ops.fused_step(work, staging=[big[::2]])


def test_negated_views_and_reshaped_gradients_are_refused_at_a_cached_address(
    ops, make_work, recorder
):
    """A negated view (torch's negative bit) shares its tensor's address, dtype and size, and
    its memory holds the opposite values: the kernel stepped with -g, or updated -p, with no
    error, found in the table cache or not. A gradient viewed to another shape at a cached
    address was likewise run where the first call refused it."""
    work = make_work("sgd", "fp32", "fp32", torch.float32, sizes=(64, 64))
    ops.fused_step(work)  # cached
    p, g = list(work.params), list(work.grads)
    stage = torch.zeros(64, dtype=torch.bfloat16)
    ops.fused_step(work, staging=[stage, None])  # cached with staging
    cases = [
        ("params", [torch._neg_view(p[0]), p[1]], None, r"parameter 0 \(slot 0.* negated view"),
        ("grads", [g[0], torch._neg_view(g[1])], None, r"gradient of parameter 1 .* negated view"),
        ("grads", [g[0], g[1].view(4, 16)], None, r"gradient of parameter 1 .* has shape \(4, 16\)"),
        ("grads", g, [torch._neg_view(stage), None], r"staging of parameter 0 .* negated view"),
    ]  # fmt: skip
    for field, value, staging, pattern in cases:
        setattr(work, field, value)
        with pytest.raises(ConfigError, match=pattern):
            ops.fused_step(work, staging=staging)
        work.params, work.grads = p, g
    assert len(recorder) == 2  # the refused calls ran nothing


def test_strided_parameters_are_written_back(ops, make_work, monkeypatch):
    """Strided parameters run on contiguous copies whose contents are copied back."""

    def fake(slot_table, n_slots, **kw):
        for row in read_table(slot_table, n_slots).tolist():
            ctypes.memset(row[0], 0x3F, row[4] * 4)  # the kernel "writes" every param

    monkeypatch.setattr(_core, "fused_step", fake)
    work = make_work("sgd", "fp32", "fp32", torch.float32, sizes=(12, 64))
    p0 = torch.randn(3, 4).t()  # strided (4, 3), 12 elements
    work.plan.params[0] = p0
    work.params = [p0, work.params[1]]
    work.grads = [torch.randn(6, 4).t()[:, ::2], work.grads[1]]  # strided gradient too
    g0 = work.grads[0].clone()
    ops.fused_step(work)
    fill = torch.tensor([0x3F3F3F3F], dtype=torch.int32).view(torch.float32).item()
    assert p0.stride() == (1, 4)
    assert bool((p0 == fill).all())
    assert bool((work.params[1] == fill).all())
    assert torch.equal(work.grads[0], g0)


def test_strided_path_validates_first(ops, make_work, recorder):
    work = make_work("sgd", "fp32", "fp32", torch.float32, sizes=(12,))
    work.params = [torch.randn(3, 4, dtype=torch.float64).t()]
    with pytest.raises(ConfigError, match=r"the group holds torch.float32 parameters"):
        ops.fused_step(work)
    work.params = [torch.empty(4, 3, device=META).t()]
    with pytest.raises(ConfigError, match=r"parameter 0 \(slot 0\) is on meta"):
        ops.fused_step(work)
    assert recorder == []


def test_parameters_that_overlap_themselves_are_refused(ops, make_work, recorder):
    """An expanded parameter (stride 0) would be updated through a contiguous copy that cannot
    be written back: refused before the kernel changes the state."""
    work = make_work("adamw", "ecc24", "q8", torch.bfloat16, sizes=(64,))
    work.params = [torch.zeros(1, dtype=torch.bfloat16).expand(64)]
    with pytest.raises(ConfigError, match=r"parameter 0 \(slot 0.*share memory"):
        ops.fused_step(work)
    assert recorder == []


def test_empty_step_calls_nothing(ops, make_work, recorder):
    ops.fused_step(make_work(slots=[]))
    ops.fused_step(make_work(sizes=(0, 0)))
    assert len(recorder) == 1
    assert recorder[0][0][:, 4].tolist() == [0, 0]


# ----------------------------------------------------------------------------------- real calls
CONFIGS = [
    pytest.param(r, m, pr, d, id=f"{r}-{m}-{str(d)[6:]}-{pr}")
    for (r, _), (m, d, _), pr in itertools.product(RULES[::3], MASTERS, PRESETS)
]


@pytest.mark.parametrize(("rule", "master", "preset", "dtype"), CONFIGS)
def test_what_python_builds_passes_the_cpp_checks(ops, make_work, rule, master, preset, dtype):
    """The real _core.fused_step accepts every configuration (results are tested elsewhere)."""
    work = make_work(rule, master, preset, dtype, sizes=(33, 1, 0, 64), momentum=0.9)
    staging = (
        None
        if dtype == torch.float16
        else [torch.empty(p.numel(), dtype=torch.bfloat16) for p in work.params]
    )
    ops.fused_step(work, staging=staging)


def test_core_fused_step_checks_its_arguments(ops, make_work, core, monkeypatch):
    captured = []
    real = core.fused_step
    monkeypatch.setattr(core, "fused_step", lambda t, n, **kw: captured.append((t, n, kw)))
    work = make_work(sizes=(33, 64))
    ops.fused_step(work)
    monkeypatch.setattr(core, "fused_step", real)
    table_addr, n, kw = captured[0]
    real(table_addr, n, **kw)  # the recorded call itself is fine

    def fails(pattern, t=table_addr, nn=n, **changes):
        with pytest.raises(ValueError, match=pattern):
            real(t, nn, **{**kw, **changes})

    fails(r"rule must be in \[0, 2\], got 3", rule=3)
    fails(r"master must be in \[0, 4\], got -1", master=-1)
    fails(r"fmt1 must be in \[0, 5\], got 6", fmt1=6)
    fails("block must be 1 or 32, got 16", block=16)
    fails("scalars must hold 8 floats", scalars=[0.0] * 7)
    fails("slot_table is required here", t=0)
    fails("n_slots must be >= 0", nn=-1)
    fails("fmt1 is FMT_NONE but this rule keeps a first state", fmt1=5)
    fails("adam needs a second state", fmt2=5)
    fails("code \\(ECC master code\\) is required here", code=0)
    fails("vs \\(second state scales\\) is required here", vs=0)
    fails("nesterov needs has_momentum", nesterov=True)
    fails("arena_offset 64 .* arena of 100 elements", arena_elements=100)
    rows = read_table(table_addr, n).clone()
    rows[1, 5] = 65  # padded not rounded to the block
    fails("slot_table row 1: padded 65 is not numel 64 rounded up", t=rows.data_ptr())
    rows = read_table(table_addr, n).clone()
    rows[0, 2] = 2  # fp16 gradient for a bf16 parameter
    fails(
        "slot_table row 0: grad_kind 2 must be GRAD_FP32 or the parameter's own dtype",
        t=rows.data_ptr(),
    )
    rows = read_table(table_addr, n).clone()
    rows[0, 0] = 0
    fails("slot_table row 0: param is required here", t=rows.data_ptr())
    rows = read_table(table_addr, n).clone()
    rows[1, 8] = -1
    fails(r"slot_table row 1: index_base -1 \(\+ padded 64\) must be >= 0 and below 2\*\*62",
          t=rows.data_ptr())  # fmt: skip
    rows[1, 8] = 2**62 - 64
    fails(r"slot_table row 1: index_base 4611686018427387840 \(\+ padded 64\)", t=rows.data_ptr())
    rows[1, 8] = 2**62 - 65
    real(rows.data_ptr(), n, **kw)  # the largest base allowed
    rows = read_table(table_addr, n).clone()
    rows[1, 4] = 2**63 - 1  # numel: rounding it up to the block overflowed int64 (UBSan)
    fails(r"slot_table row 1: numel 9223372036854775807 must be in \[0, 2\*\*62\]",
          t=rows.data_ptr())  # fmt: skip
    rows = read_table(table_addr, n).clone()
    rows[0, 0] += 1  # a bf16 parameter at an odd address
    fails(r"slot_table row 0: param: address \d+ is not a multiple of its element size, 2 bytes",
          t=rows.data_ptr())  # fmt: skip
    rows = read_table(table_addr, n).clone()
    rows[1, 1] += 2  # an fp32 gradient two bytes off
    rows[1, 2] = 0
    fails(r"slot_table row 1: grad: address \d+ is not a multiple of its element size, 4 bytes",
          t=rows.data_ptr())  # fmt: skip


def _misaligned(n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` elements of ``dtype`` one byte past an aligned address (torch.frombuffer with an
    offset makes such tensors; so does an unaligned numpy array)."""
    size = torch.empty(0, dtype=dtype).element_size()
    t = torch.frombuffer(bytearray(size * n + 64), dtype=dtype, offset=1, count=n)
    assert t.data_ptr() % size == 1
    return t


def test_misaligned_tensors_are_refused(ops, make_work, recorder):
    """The kernels read whole elements through typed pointers: a tensor at an address that is
    not a multiple of its element size was accessed misaligned (undefined behaviour in C++,
    flagged by UBSan; a fault where the compiler uses aligned vector loads)."""
    x = _misaligned(64, torch.float32)
    with pytest.raises(ConfigError, match=r"x starts at address \d+, not a multiple of its "):
        ops.encode_moment("bf16", x)
    ops.encode_moment("bf16", x.clone())  # an aligned copy is taken
    base = make_work()
    p, g = base.params, base.grads
    bad_p = _misaligned(p[0].numel(), p[0].dtype).view(p[0].shape)
    bad_g = _misaligned(g[1].numel(), g[1].dtype).view(g[1].shape)
    for changes, pattern in (
        ({"params": [bad_p, *p[1:]]}, r"parameter 0 \(slot 0\) starts at address"),
        ({"grads": [g[0], bad_g, *g[2:]]}, r"the gradient of parameter 1 .* starts at address"),
    ):
        work = make_work()
        for k, v in changes.items():
            setattr(work, k, v)
        with pytest.raises(ConfigError, match=pattern):
            ops.fused_step(work)
    assert not recorder


# ----------------------------------------------------------------------------------- GPU host
CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dev", [pytest.param("cuda", marks=CUDA)])
def test_cuda_tensors_are_refused(ops, make_work, recorder, dev):
    from memopt_core import backends
    from memopt_kernels_cpu.backend import BACKEND

    x = torch.randn(64, device=dev)
    with pytest.raises(ConfigError, match=r"x is on cuda:0: move it with \.cpu\(\)"):
        ops.encode_moment("fp32", x)
    with pytest.raises(ConfigError, match=r"param is on cuda:0"):
        ops.decode_master("none", x.bfloat16())
    work = make_work()
    work.grads = [g.to(dev) for g in work.grads]
    with pytest.raises(ConfigError, match=r"the gradient of parameter 0 .* is on cuda:0"):
        ops.fused_step(work)
    assert recorder == []
    spec = StateSpec(master="ecc24", moments="q8")
    assert not BACKEND.supports("adam", spec, torch.device(dev), torch.bfloat16)
    assert backends.select_backend("adam", spec, dev, torch.bfloat16, "auto").name != "cpu"


@pytest.mark.parametrize("dev", [pytest.param("cuda", marks=CUDA)])
def test_pinned_host_buffers(ops, make_work, dev):
    """memopt-offload's setting: pinned parameters, gradients and bf16 staging buffers."""
    work = make_work(sizes=(33, 4097, 64))
    pinned = [p.pin_memory() for p in work.params]
    work.plan.params[:] = pinned
    work.params = list(pinned)
    work.grads = [g.pin_memory() for g in work.grads]
    staging = [torch.empty(p.numel(), dtype=torch.bfloat16).pin_memory() for p in pinned]
    for st in staging:
        st.fill_(1.0)
        assert ops.first_touch(st) is st
        assert int(st.count_nonzero()) == 0
    ops.fused_step(work, staging=staging)
    on_gpu = [st.to(dev, non_blocking=True) for st in staging]
    torch.cuda.synchronize()
    for st, g in zip(staging, on_gpu, strict=True):
        assert torch.equal(g.cpu().view(torch.int16), st.view(torch.int16))


def test_an_optimizer_step_refused_in_a_later_group_changes_nothing(monkeypatch):
    """The cpu backend refuses a gradient that shares another parameter's memory; when that is
    the second group's, the first group must not have been updated (core checks every group
    first)."""
    from memopt_core import MemOptimizer

    monkeypatch.setenv("MEMOPT_BACKEND", "cpu")
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
    buf = torch.randn(65, dtype=torch.bfloat16)
    b = torch.nn.Parameter(buf[:64])
    opt = MemOptimizer(
        [{"params": [a]}, {"params": [b], "lr": 1e-2}], rule="adamw", master="ecc24", moments="q8"
    )
    a.grad = torch.randn(64, dtype=torch.bfloat16)
    b.grad = buf[1:]  # a shifted view of its own parameter
    a0 = a.detach().clone()
    with pytest.raises(ConfigError, match="share memory"):
        opt.step()
    assert torch.equal(a, a0)
    b.grad = torch.randn(64, dtype=torch.bfloat16)
    opt.step()  # the first real step: step count 1 for both groups
    assert [int(s["step"]) for s in opt.state_dict()["state"].values()] == [1, 1]


@pytest.mark.parametrize(
    ("rule", "dtype", "master", "moments"),
    [
        ("adamw", torch.bfloat16, "ecc24", "q8"),
        ("adamw", torch.bfloat16, "ecc32", "bf16"),
        ("adamw", torch.bfloat16, "none", "fp8"),
        # fp32 parameters update in place, and SGD's and Lion's decay pass wrote every weight
        # before the update read the gradient (audit round 4)
        ("sgdw", torch.float32, "none", "fp32"),
        ("sgdw", torch.float32, "none", "q8"),
        ("lion", torch.float32, "none", "fp32"),
        ("adamw", torch.float32, "none", "fp32"),
    ],
)
def test_a_gradient_that_is_its_own_parameter_steps_as_the_reference(rule, dtype, master, moments):
    """``p.grad = p.detach()``: every element's gradient is read before the element is written,
    so the step computes with ``g = p``, the same bits as core's torch backend."""
    from memopt_core import MemOptimizer

    results = []
    for backend in ("cpu", "torch"):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, dtype=dtype)) for n in (1, 33, 1000)]
        momentum = {"momentum": 0.9} if rule == "sgdw" else {}
        opt = MemOptimizer(
            ps, rule=rule, lr=1e-2, weight_decay=0.5, master=master, moments=moments,
            backend=backend, **momentum,
        )  # fmt: skip
        for _ in range(3):
            for p in ps:
                p.grad = p.detach()
            opt.step()
        results.append([bits(p) for p in ps] + [bits(v) for p in ps for v in opt.state[p].values()])
    assert all(map(torch.equal, *results))


# ------------------------------------------------------------ through an optimizer (audit)
def test_a_tensor_subclass_without_memory_is_refused_by_name():
    """A wrapper subclass (torch's TwoTensor stands for torchao-style ones) has data pointer 0:
    refused naming the parameter, not deep in the slot table's address check."""
    from torch.testing._internal.two_tensor import TwoTensor

    from memopt_core import MemOptimizer

    base = torch.randn(4, 8)
    p = torch.nn.Parameter(TwoTensor(base.clone(), base.clone()))
    opt = MemOptimizer([p], backend="cpu")
    p.grad = TwoTensor(torch.ones(4, 8), torch.ones(4, 8))
    with pytest.raises(ConfigError, match=r"parameter 0 .* is a TwoTensor without memory"):
        opt.step()


def test_an_interrupt_as_the_kernel_returns_keeps_a_strided_parameter_whole(monkeypatch):
    """A strided parameter is updated through a contiguous copy written back after the kernel.
    A KeyboardInterrupt delivered as the kernel returns skipped the write-back: the ECC-24 code
    and the moments were new, the bf16 weight old (the decoded master was neither)."""
    import memopt_kernels_cpu.ops as cpu_ops
    from memopt_core import MemOptimizer

    def make():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(48, 40).to(torch.bfloat16).t())  # not contiguous
        return p, MemOptimizer([p], master="ecc24", moments="q8", backend="cpu")

    grads = [torch.randn(40, 48, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    p, opt = make()
    for g in grads:
        p.grad = g.to(torch.bfloat16)
        opt.step()
    clean_p, clean_code = p.detach().clone(), opt.state[p]["master_code"].clone()

    class Interrupting:
        def __getattr__(self, name):
            return getattr(_core, name)

        @staticmethod
        def fused_step(*args, **kw):
            _core.fused_step(*args, **kw)
            raise KeyboardInterrupt

    p, opt = make()
    p.grad = grads[0].to(torch.bfloat16)
    opt.step()
    p.grad = grads[1].to(torch.bfloat16)
    monkeypatch.setattr(cpu_ops, "_core", Interrupting())
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    monkeypatch.undo()
    assert torch.equal(p.detach(), clean_p)
    assert torch.equal(opt.state[p]["master_code"], clean_code)
    assert opt.state[p]["step"].item() == 2
