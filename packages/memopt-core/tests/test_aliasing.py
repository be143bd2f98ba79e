"""memopt_core.aliasing: which shared memory a kernel call must refuse."""

from __future__ import annotations

import pytest
import torch

from memopt_core.aliasing import (
    any_extents_overlap,
    check_aliasing,
    check_parameters_apart,
    clear_of,
    ranges_overlap,
    refuse_negated,
    sorted_extents,
)
from memopt_core.errors import ConfigError
from memopt_core.plan import overlaps_itself


def test_disjoint_views_and_shared_reads_pass():
    buf = torch.zeros(100)
    check_aliasing([(buf[:50], "a"), (buf[50:], "b")], [(torch.zeros(3), "g")])
    g = torch.zeros(10)
    check_aliasing([(buf[:10], "a")], [(g, "g0"), (g, "g1")])  # two reads of one tensor
    check_aliasing([(buf[0::2], "even")], [(buf[1::2], "odd")])  # interleaved, no shared byte


def test_a_gradient_may_be_exactly_its_own_parameter():
    p = torch.zeros(4, 8)
    g, gt = p.detach(), p.t()
    check_aliasing([(p, "p")], [(g, "g")], [(p, g)])
    with pytest.raises(ConfigError, match="p and g share memory"):  # not given as a pair
        check_aliasing([(p, "p")], [(g, "g")])
    with pytest.raises(ConfigError, match="share memory"):  # a pair, but another view of it
        check_aliasing([(p, "p")], [(gt, "g")], [(p, gt)])


def test_overlaps_are_refused_with_both_names():
    buf = torch.zeros(100)
    with pytest.raises(ConfigError, match=r"a and b share memory; the kernel writes a in place"):
        check_aliasing([(buf[:50], "a")], [(buf[49:60], "b")])
    with pytest.raises(ConfigError, match=r"a and b share memory"):
        check_aliasing([(buf[:50], "a"), (buf[40:], lambda: "b")], [])
    with pytest.raises(ConfigError, match="share memory"):  # strided, sharing one element
        check_aliasing([(buf[0::3], "a")], [(buf[3:4], "b")])


def test_overlap_after_an_empty_tensor_inside_a_range():
    buf = torch.zeros(100)
    with pytest.raises(ConfigError, match="share memory"):
        check_aliasing([(buf[:50], "a"), (buf[10:10], "empty")], [(buf[20:30], "b")])


def test_pair_with_other_strides_is_not_the_same_view():
    base = torch.zeros(4, 4)
    p = base[:, :2]  # shape (4,2) strides (4,1)
    g = torch.as_strided(base, (4, 2), (1, 4))  # same ptr/shape/dtype, other strides
    with pytest.raises(ConfigError, match="share memory"):
        check_aliasing([(p, "p")], [(g, "g")], [(p, g)])


def test_adjacent_tensors_next_to_a_strided_one_pass():
    buf = torch.zeros(100)
    # a strided tensor makes the quick check defer to the exact one
    check_aliasing([(buf[0:10], "a"), (buf[10:20], "b")], [(torch.zeros(8, 2)[:, 0], "s")])


def test_strided_extent_includes_its_last_element():
    buf = torch.zeros(100)
    s = buf[0:10:3]  # elements 0,3,6,9
    with pytest.raises(ConfigError, match="share memory"):
        check_aliasing([(s, "s")], [(buf[9:12], "b")])


@pytest.mark.parametrize(("shape", "stride"), [((4,), (0,)), ((3, 4), (0, 1)), ((2, 3), (1, 1))])
def test_overlaps_itself(shape, stride):
    t = torch.as_strided(torch.zeros(16), shape, stride)
    assert overlaps_itself(t)


def test_expanded_parameter_refused():
    p = torch.zeros(1).expand(4)
    with pytest.raises(ConfigError, match="share memory"):
        check_parameters_apart([(p, "p")], [])


def test_clear_of_finds_every_overlap_with_sorted_extents():
    """The cached step's check of moved gradients: against brute force over random ranges."""
    buf = torch.zeros(4096, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        cuts = sorted(torch.randint(0, 4096, (8,), generator=gen).tolist())
        written = [buf[a:b] for a, b in zip(cuts[::2], cuts[1::2], strict=True)]
        ext = sorted_extents(written[::-1])  # any order in
        reads = []
        for _ in range(3):
            a, b = sorted(torch.randint(0, 4096, (2,), generator=gen).tolist())
            reads.append(buf[a : max(b, a + 1)])  # not empty (one inside a range counts as a hit)
        want = not any(
            r.numel()
            and w.numel()
            and r.data_ptr() < w.data_ptr() + w.nbytes
            and w.data_ptr() < r.data_ptr() + r.nbytes
            for r in reads
            for w in written
        )
        nbytes = [r.nbytes for r in reads]
        assert clear_of(ext, [r.data_ptr() for r in reads], nbytes) == want
    assert sorted_extents([buf[::2]]) is None  # strided: no exact extent
    assert not clear_of(None, [buf.data_ptr()], [1])
    assert clear_of(sorted_extents([buf[:8]]), [], [])


def test_ranges_overlap_against_brute_force():
    """The sorted scan (the backends' fast check before labelling tensors) against every pair,
    empty ranges, shared starts and ranges nested in others included."""
    gen = torch.Generator().manual_seed(1)
    buf = torch.zeros(64, dtype=torch.uint8)
    for trial in range(2000):
        k = int(torch.randint(0, 7, (1,), generator=gen))
        starts = torch.randint(0, 60, (k,), generator=gen).tolist()
        stops = [a + int(torch.randint(0, 5, (1,), generator=gen)) for a in starts]
        want = any(
            max(starts[i], starts[j]) < min(stops[i], stops[j])
            for i in range(k)
            for j in range(i + 1, k)
        )
        assert ranges_overlap(starts, stops) == want, (trial, starts, stops)
        views = [buf[a:b] for a, b in zip(starts, stops, strict=True)]
        assert any_extents_overlap(views) == want, (trial, starts, stops)
    assert any_extents_overlap([buf[::2], buf[40:]])  # strided: left to the exact check


def test_refuse_negated_names_the_tensor_and_the_fix():
    """A negated view's memory holds the opposite of its values, which kernels read as they are:
    refused with the caller's name (a str, or a callable made only for the error)."""
    x = torch.tensor([1.0, -2.0])
    for neg in (torch._neg_view(x), torch.tensor([1 + 3j]).conj().imag):
        assert neg.is_neg()
        with pytest.raises(
            ConfigError,
            match=r"^the gradient of parameter 0 is a negated view \(torch's negative bit.*"
            r"opposite values.*; pass its \.resolve_neg\(\) instead$",
        ):
            refuse_negated("the gradient of parameter 0", neg)
    with pytest.raises(ConfigError, match=r"^staging of p is a negated view"):
        refuse_negated(lambda: "staging of p", torch._neg_view(x))
    made = []
    refuse_negated(lambda: made.append(1) or "x", x)  # not negated: nothing raised, no label
    refuse_negated("x", torch._neg_view(x).resolve_neg())
    refuse_negated("x", -x)  # a real negation has its values in memory
    assert made == []
