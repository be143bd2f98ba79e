"""``q8_sqrt``'s stochastic rounding (KERNEL_API 7: integer arithmetic on ``s``'s fraction between
its two codes) against core's reference at the decision's threshold: every code, random
fractions, and words within two of the threshold on both sides, where an off-by-one in the
kernel's comparison would show."""

from __future__ import annotations

import torch

from memopt_core.formats import moment_codec
from memopt_core.testing import bits, q8_sqrt_threshold_cases


def test_decisions_at_the_threshold_equal_the_reference(ops, device):
    codec = moment_codec("q8_sqrt")
    for seed in (0, 1):
        v, _, r = q8_sqrt_threshold_cases(seed)
        want = codec.encode(v, rand=r)
        got = ops.encode_moment("q8_sqrt", v.to(device), rand=r.to(device))
        for key in want:
            assert torch.equal(bits(got[key]), bits(want[key])), key
        lo = codec.encode(v, rand=torch.full_like(r, 2**32 - 1))
        ups = (want[""].to(torch.int64) - lo[""].to(torch.int64)).sum().item()
        assert v.numel() // 4 < ups < v.numel() * 3 // 4  # both decisions occur
