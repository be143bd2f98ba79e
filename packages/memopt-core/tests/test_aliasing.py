"""memopt_core.aliasing: which shared memory a kernel call must refuse."""

from __future__ import annotations

import pytest
import torch

from memopt_core.aliasing import check_aliasing
from memopt_core.errors import ConfigError


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
