"""Philox4x32-10: Random123 known answers, uniformity, reproducibility."""

from __future__ import annotations

import pytest
import torch

from memopt_core import rng

# Random123's tests/kat_vectors, "philox4x32 10" lines: counter[4], key[2] -> output[4].
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("ctr", "key", "want"), KAT)
def test_known_answers(ctr, key, want):
    assert tuple(int(v) for v in rng.philox4x32(*ctr, *key)) == want
    # the same through tensors, broadcast against a batch
    batch = [torch.tensor([c, c], dtype=torch.int64) for c in ctr]
    out = rng.philox4x32(*batch, *key)
    assert all(o.tolist() == [w, w] for o, w in zip(out, want, strict=False))


def test_uniform_bits_layout():
    index = torch.tensor([0, 5, 2**32 + 7], dtype=torch.int64)
    got = rng.uniform_bits(123, 9, index, 17, rng.STREAM_SECOND)
    want = rng.philox4x32(index & 0xFFFFFFFF, index >> 32, 17, 0, 123, 9)[rng.STREAM_SECOND]
    assert torch.equal(got, want)
    assert got.dtype == torch.int64
    assert int(got.min()) >= 0
    assert int(got.max()) < 2**32
    # per-element tensor ids broadcast
    ids = torch.tensor([9, 9, 10])
    assert torch.equal(rng.uniform_bits(123, ids, index, 17, 2)[:2], got[:2])


def test_uniformity():
    n = 1 << 18
    w = rng.uniform_bits(0, 0, torch.arange(n), 1, rng.STREAM_MASTER)
    u = w.double() / 2**32
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / n) ** 0.5
    counts = torch.bincount((w >> 24).long(), minlength=256).double()  # top byte, 256 cells
    chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum().item()
    assert chi2 < 255 + 6 * (2 * 255) ** 0.5  # mean 255, sd ~22.6
    low = torch.bincount((w & 0xFF).long(), minlength=256).double()  # low byte too
    assert ((low - n / 256) ** 2 / (n / 256)).sum().item() < 255 + 6 * (2 * 255) ** 0.5
    for b in range(32):  # every bit is set about half the time
        assert abs(((w >> b) & 1).double().mean().item() - 0.5) < 5 * 0.5 / n**0.5


def test_reproducible_and_distinct():
    idx = torch.arange(4096)
    a = rng.uniform_bits(7, 3, idx, 100, rng.STREAM_FIRST)
    assert torch.equal(a, rng.uniform_bits(7, 3, idx, 100, rng.STREAM_FIRST))
    for other in [(8, 3, 100, 1), (7, 4, 100, 1), (7, 3, 101, 1), (7, 3, 100, 2)]:
        b = rng.uniform_bits(other[0], other[1], idx, other[2], other[3])
        assert (a == b).double().mean().item() < 0.01
    # a chunk computed alone equals the same elements of the whole (counter based)
    assert torch.equal(rng.uniform_bits(7, 3, idx[1000:1100], 100, 1), a[1000:1100])
