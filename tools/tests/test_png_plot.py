"""The PNG writer: valid files (chunks, CRCs, pixel data) and the chart layout helpers."""

from __future__ import annotations

import math
import struct
import zlib

import pytest
from png_plot import (
    BLACK,
    PALETTE,
    WHITE,
    Canvas,
    Panel,
    Series,
    format_tick,
    nice_ticks,
    render_chart,
    text_width,
    write_chart_png,
)


def decode(png: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, RGB rows) of an 8-bit RGB, unfiltered PNG; checks every chunk's CRC."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind, data = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", png[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + data)
        chunks.append((kind, data))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR"
    assert chunks[-1] == (b"IEND", b"")
    width, height, depth, color, *_ = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(b"".join(d for k, d in chunks if k == b"IDAT"))
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    assert all(raw[y * stride] == 0 for y in range(height))
    return width, height, [raw[y * stride + 1 : (y + 1) * stride] for y in range(height)]


def pixel(rows: list[bytes], x: int, y: int) -> tuple[int, ...]:
    return tuple(rows[y][3 * x : 3 * x + 3])


def test_canvas_round_trips_through_png() -> None:
    canvas = Canvas(7, 5)
    canvas.rect(2, 1, 4, 3, (10, 20, 30))
    canvas.set(6, 4, (1, 2, 3))
    canvas.set(99, 99, (1, 2, 3))  # off the canvas: ignored
    width, height, rows = decode(canvas.png())
    assert (width, height) == (7, 5)
    assert pixel(rows, 2, 1) == pixel(rows, 3, 2) == (10, 20, 30)
    assert pixel(rows, 4, 1) == pixel(rows, 0, 0) == WHITE
    assert pixel(rows, 6, 4) == (1, 2, 3)


def test_line_reaches_both_ends_in_any_direction() -> None:
    canvas = Canvas(20, 20)
    canvas.line(17, 3, 2, 15, BLACK)
    _, _, rows = decode(canvas.png())
    assert pixel(rows, 17, 3) == pixel(rows, 2, 15) == BLACK
    assert sum(row.count(b"\x00\x00\x00") for row in rows) >= 15  # one pixel per column at least


def test_text_stays_inside_its_measured_width() -> None:
    canvas = Canvas(80, 20)
    canvas.text(1, 1, "AdamW 2.5", BLACK, scale=1)
    _, _, rows = decode(canvas.png())
    inked = [x for y in range(20) for x in range(80) if pixel(rows, x, y) == BLACK]
    assert inked
    assert min(inked) >= 1
    assert max(inked) < 1 + text_width("AdamW 2.5")


@pytest.mark.parametrize(
    ("lo", "hi", "expected"),
    [(0, 250, [0, 50, 100, 150, 200, 250]), (2.31, 5.62, [2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5])],
)
def test_nice_ticks(lo: float, hi: float, expected: list[float]) -> None:
    assert nice_ticks(lo, hi) == pytest.approx(expected)


def test_tick_labels_have_just_enough_decimals() -> None:
    assert [format_tick(v, [0, 50]) for v in (0, 50)] == ["0", "50"]
    assert format_tick(2.5, [2.5, 3.0]) == "2.5"
    assert format_tick(0.25, [0.25, 0.5]) == "0.25"


def test_chart_draws_every_series_color_and_skips_non_finite_points(tmp_path) -> None:
    a = Series("torch AdamW", [(0, 5.5), (50, 3.0), (100, math.nan), (150, 2.5)])
    b = Series("memopt q8", [(0, 5.4), (150, 2.6)])
    lone = Series("single point", [(10, 4.0)])
    path = write_chart_png(
        tmp_path / "c.png", [Panel("train", [a, b, lone]), Panel("empty", [])], 600, 300
    )
    width, height, rows = decode(path.read_bytes())
    assert (width, height) == (600, 300)
    colors = {pixel(rows, x, y) for y in range(height) for x in range(width)}
    assert set(PALETTE[:3]) <= colors


def test_same_label_same_color_across_panels() -> None:
    canvas = render_chart(
        [Panel("a", [Series("x", [(0, 1), (1, 2)])]), Panel("b", [Series("x", [(0, 1), (1, 0)])])],
        400,
        200,
    )
    _, _, rows = decode(canvas.png())
    colors = {pixel(rows, x, y) for y in range(200) for x in range(400)}
    assert PALETTE[0] in colors
    assert PALETTE[1] not in colors
