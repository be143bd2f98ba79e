"""Stochastic-rounding words: Philox4x32-10 known answers, the word layout against a scalar
re-implementation, and the statistics stochastic rounding relies on."""

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
M32 = 0xFFFFFFFF


@pytest.mark.parametrize(("ctr", "key", "want"), KAT)
def test_known_answers(ctr, key, want):
    assert tuple(int(v) for v in rng.philox4x32(*ctr, *key)) == want
    # the same through tensors, broadcast against a batch
    batch = [torch.tensor([c, c], dtype=torch.int64) for c in ctr]
    out = rng.philox4x32(*batch, *key)
    assert all(o.tolist() == [w, w] for o, w in zip(out, want, strict=False))


def _scalar_philox(ctr, key):
    """Random123's round in plain Python integers, independent of the tensor code."""
    x, k = list(ctr), list(key)
    for r in range(10):
        if r:
            k = [(k[0] + rng.PHILOX_W0) & M32, (k[1] + rng.PHILOX_W1) & M32]
        p0, p1 = x[0] * rng.PHILOX_M0, x[2] * rng.PHILOX_M1
        x = [(p1 >> 32) ^ x[1] ^ k[0], p1 & M32, (p0 >> 32) ^ x[3] ^ k[1], p0 & M32]
    return x


def _scalar_word(seed, tid, index, step, stream):
    """The documented definition, one element at a time in Python integers."""
    keys = _scalar_philox((step & M32, 0, 0, 0), (seed & M32, tid & M32))
    x = ((index & M32) * 0x9E3779B9 + (index >> 32) * keys[3]) & M32
    x ^= keys[stream]
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


@pytest.mark.parametrize(
    ("seed", "tid", "step"), [(0, 0, 1), (123, 9, 17), (M32, M32, M32), (2**31 + 5, 70000, 2**20)]
)
def test_words_follow_the_definition(seed, tid, step):
    index = torch.tensor(
        [0, 1, 5, 2**31, 2**32 - 1, 2**32, 2**32 + 7, 2**33 + 1, 2**40 + 3, 2**62 + 11],
        dtype=torch.int64,
    )
    words = rng.stream_words(seed, tid, index, step)
    assert len(words) == 3
    for stream, got in enumerate(words):
        assert got.dtype == torch.int64
        want = [_scalar_word(seed, tid, int(i), step, stream) for i in index]
        assert got.tolist() == want, stream
        assert torch.equal(rng.uniform_bits(seed, tid, index, step, stream), got)


def test_lowbias32_is_a_bijection_on_a_sample():
    x = torch.randint(0, 2**32, (1 << 16,), dtype=torch.int64)
    x = torch.unique(x)
    y = rng.lowbias32(x)
    assert int(y.min()) >= 0
    assert int(y.max()) < 2**32
    assert torch.unique(y).numel() == x.numel()
    assert int(rng.lowbias32(torch.tensor(0))) == 0


def test_broadcasting_and_per_element_ids():
    index = torch.tensor([0, 5, 2**32 + 7], dtype=torch.int64)
    got = rng.uniform_bits(123, 9, index, 17, rng.STREAM_SECOND)
    ids = torch.tensor([9, 9, 10])
    mixed = rng.uniform_bits(123, ids, index, 17, rng.STREAM_SECOND)
    assert torch.equal(mixed[:2], got[:2])
    assert int(mixed[2]) == int(rng.uniform_bits(123, 10, index[2:], 17, 2))
    # a column of steps against a row of indices
    steps = torch.tensor([[3], [4]])
    grid = rng.uniform_bits(1, 2, index, steps, 0)
    assert grid.shape == (2, 3)
    assert torch.equal(grid[1], rng.uniform_bits(1, 2, index, 4, 0))
    with pytest.raises(ValueError, match="stream"):
        rng.uniform_bits(1, 2, index, 4, 3)


def _chi2_uniform(cells: torch.Tensor, n: int) -> float:
    e = n / cells.numel()
    return ((cells.double() - e) ** 2 / e).sum().item()


def _chi2_bound(cells: int) -> float:
    return (cells - 1) + 6 * (2 * (cells - 1)) ** 0.5  # mean k-1, 6 standard deviations


def _check_uniform(w: torch.Tensor) -> None:
    n = w.numel()
    u = w.double() / 2**32
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / n) ** 0.5
    for cells in ((w >> 24), (w >> 8) & 0xFF, w & 0xFF):  # top, SR's lowest and the low byte
        assert _chi2_uniform(torch.bincount(cells, minlength=256), n) < _chi2_bound(256)
    for b in range(32):  # every bit is set about half the time
        assert abs(((w >> b) & 1).double().mean().item() - 0.5) < 5 * 0.5 / n**0.5


@pytest.mark.parametrize("stream", [0, 1, 2])
def test_uniform_over_the_elements_of_a_step(stream):
    _check_uniform(rng.uniform_bits(0, 0, torch.arange(1 << 18), 1, stream))


def test_uniform_over_the_steps_of_an_element():
    # what stochastic rounding's unbiasedness rests on: one element's words from step to step
    steps = torch.arange(1, (1 << 17) + 1).unsqueeze(1)
    w = rng.uniform_bits(3, 1, torch.tensor([0, 2**32 + 9]), steps, rng.STREAM_FIRST)
    _check_uniform(w[:, 0].contiguous())
    _check_uniform(w[:, 1].contiguous())


def _pair_chi2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square of the joint top-4-bit cells of two word sequences (256 cells)."""
    cells = (a >> 28) * 16 + (b >> 28)
    return _chi2_uniform(torch.bincount(cells, minlength=256), a.numel())


def test_no_correlation_between_streams_neighbours_and_steps():
    n = 1 << 20
    idx = torch.arange(n)
    w0, w1, w2 = rng.stream_words(5, 2, idx, 40)
    for a, b in ((w0, w1), (w1, w2), (w0, w2)):  # the streams of one element
        assert _pair_chi2(a, b) < _chi2_bound(256)
    for lag in (1, 2, 3, 16, 1024, 65536):  # neighbouring elements of one step
        assert _pair_chi2(w1[:-lag], w1[lag:]) < _chi2_bound(256)
    # one element at consecutive steps
    steps = torch.arange(1, n + 2).unsqueeze(1)
    s = rng.uniform_bits(5, 2, torch.tensor([77]), steps, 2)[:, 0]
    assert _pair_chi2(s[:-1], s[1:]) < _chi2_bound(256)
    # and the linear correlation of neighbours is at noise level
    u = w1.double() / 2**32 - 0.5
    assert abs((u[:-1] * u[1:]).mean().item()) < 6 * (1 / 144 / n) ** 0.5


def test_reproducible_and_distinct():
    idx = torch.arange(4096)
    a = rng.uniform_bits(7, 3, idx, 100, rng.STREAM_FIRST)
    assert torch.equal(a, rng.uniform_bits(7, 3, idx, 100, rng.STREAM_FIRST))
    for other in [(8, 3, 100, 1), (7, 4, 100, 1), (7, 3, 101, 1), (7, 3, 100, 2), (7, 3, 100, 0)]:
        b = rng.uniform_bits(other[0], other[1], idx, other[2], other[3])
        assert (a == b).double().mean().item() < 0.01
    # a chunk computed alone equals the same elements of the whole (counter based)
    assert torch.equal(rng.uniform_bits(7, 3, idx[1000:1100], 100, 1), a[1000:1100])


def test_indices_beyond_32_bits_are_distinct_elements():
    # i and i + 2**32 fold to different y (K3 != 0), and a pair of a tensor larger than 2**32
    # elements that shares y at one step does not share it at the next
    idx = torch.arange(1024)
    for step in range(1, 6):
        lo = rng.uniform_bits(1, 1, idx, step, 0)
        hi = rng.uniform_bits(1, 1, idx + 2**32, step, 0)
        assert (lo == hi).double().mean().item() < 0.01
    k3 = [int(rng.step_keys(1, 1, s)[3]) for s in (1, 2)]
    # element (lo, hi = 0) with lo * INDEX_M = K3 and element (lo = 0, hi = 1) collide at step 1
    lo = k3[0] * pow(rng.INDEX_M, -1, 2**32) % 2**32
    pair = torch.tensor([lo, 2**32])
    assert int(rng.fold_index(pair, k3[0])[0]) == int(rng.fold_index(pair, k3[0])[1])
    assert int(rng.fold_index(pair, k3[1])[0]) != int(rng.fold_index(pair, k3[1])[1])
