"""Line charts as PNG files with the standard library only (zlib + struct).

Lines are rasterized into an RGB buffer with axes, ticks, labels and a legend of colored swatches;
text uses a built-in 5x7 bitmap font (upper case, digits and a little punctuation).
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

Color = tuple[int, int, int]

WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GRID: Color = (225, 225, 225)
# Tableau 10: distinct colors that stay distinct in print and for common color blindness.
PALETTE: tuple[Color, ...] = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)

# 5x7 glyphs: seven rows as hex bytes, top to bottom, bit 4 = leftmost column.
_FONT_HEX = {
    "0": "0E11131519110E", "1": "040C040404040E", "2": "0E11010204081F",
    "3": "1F02040201110E", "4": "02060A121F0202", "5": "1F101E0101110E",
    "6": "0608101E11110E", "7": "1F010204080808", "8": "0E11110E11110E",
    "9": "0E11110F01020C", "A": "0E1111111F1111", "B": "1E11111E11111E",
    "C": "0E11101010110E", "D": "1C12111111121C", "E": "1F10101E10101F",
    "F": "1F10101E101010", "G": "0E11101711110F", "H": "1111111F111111",
    "I": "0E04040404040E", "J": "0702020202120C", "K": "11121418141211",
    "L": "1010101010101F", "M": "111B1515111111", "N": "11111915131111",
    "O": "0E11111111110E", "P": "1E11111E101010", "Q": "0E11111115120D",
    "R": "1E11111E141211", "S": "0F10100E01011E", "T": "1F040404040404",
    "U": "1111111111110E", "V": "11111111110A04", "W": "1111111515150A",
    "X": "11110A040A1111", "Y": "1111110A040404", "Z": "1F01020408101F",
    ".": "00000000000C0C", "-": "0000001F000000", "+": "0004041F040400",
    "_": "0000000000001F", "(": "02040808080402", ")": "08040202020408",
    ":": "000C0C000C0C00", "/": "00010204081000", "=": "00001F001F0000",
    ",": "000000000C0408", "%": "18190204081303", " ": "00000000000000",
}  # fmt: skip
FONT: dict[str, tuple[int, ...]] = {
    ch: tuple(bytes.fromhex(rows)) for ch, rows in _FONT_HEX.items()
}
GLYPH_W, GLYPH_H = 5, 7


class Canvas:
    """An RGB raster with the drawing primitives the charts need."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill the half-open rectangle [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, x0), min(self.width, x1)
        if x1 <= x0:
            return
        row = bytes(color) * (x1 - x0)
        for y in range(max(0, y0), min(self.height, y1)):
            i = 3 * (y * self.width + x0)
            self.pixels[i : i + len(row)] = row

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
        """Bresenham's line with a square brush of ``width`` pixels."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.rect(x0, y0, x0 + width, y0 + width, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, color: Color = BLACK, scale: int = 1) -> None:
        """Draw ``s`` with its top-left corner at (x, y); unknown characters draw as blanks."""
        for k, ch in enumerate(s.upper()):
            rows = FONT.get(ch, FONT[" "])
            left = x + k * (GLYPH_W + 1) * scale
            for r, bits in enumerate(rows):
                for c in range(GLYPH_W):
                    if bits >> (GLYPH_W - 1 - c) & 1:
                        top = y + r * scale
                        self.rect(left + c * scale, top, left + (c + 1) * scale, top + scale, color)

    def png(self) -> bytes:
        """The canvas encoded as an 8-bit RGB PNG."""
        stride = 3 * self.width
        # Each scanline is prefixed with filter type 0 (none); zlib does the compression.
        raw = b"".join(
            b"\x00" + self.pixels[y * stride : (y + 1) * stride] for y in range(self.height)
        )
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(raw, 9))
            + _chunk(b"IEND", b"")
        )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def text_width(s: str, scale: int = 1) -> int:
    """Pixel width of ``s`` as :meth:`Canvas.text` draws it."""
    return max(0, len(s) * (GLYPH_W + 1) * scale - scale)


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """About ``target`` round tick values (1, 2 or 5 times a power of ten apart) in [lo, hi]."""
    if not hi > lo:
        hi = lo + 1.0
    raw = (hi - lo) / (max(1, target) + 1)  # the smallest step allowed: at most target + 1 gaps
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9)
    last = math.floor(hi / step + 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def format_tick(value: float, ticks: Sequence[float]) -> str:
    """A tick label with just enough decimals to tell neighbouring ticks apart."""
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else 1.0
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    while abs(round(step, decimals) - step) > 1e-9 * step and decimals < 12:
        decimals += 1  # a step such as 0.25 needs more digits than its leading one
    return f"{value:.{decimals}f}"


@dataclass(frozen=True)
class Series:
    """One curve: a label and its (x, y) points; non-finite points are skipped."""

    label: str
    points: Sequence[tuple[float, float]]


@dataclass(frozen=True)
class Panel:
    """One chart: a title, an x-axis label and its curves."""

    title: str
    series: Sequence[Series]
    x_label: str = "step"


def _draw_panel(
    canvas: Canvas, panel: Panel, box: tuple[int, int, int, int], colors: dict[str, Color]
) -> None:
    x0, y0, x1, y1 = box  # outer box; the plot area leaves room for tick labels and titles
    s = 2  # font scale
    pts = [
        (x, y) for sr in panel.series for x, y in sr.points if math.isfinite(x) and math.isfinite(y)
    ]
    xs, ys = [p[0] for p in pts] or [0.0, 1.0], [p[1] for p in pts] or [0.0, 1.0]
    pad = 0.05 * ((max(ys) - min(ys)) or 1.0)
    # The x axis starts at zero (or below) so panels of steps line up.
    xlo = min(0.0, *xs)
    xhi = max(xs) if max(xs) > xlo else xlo + 1
    ylo, yhi = min(ys) - pad, max(ys) + pad
    xt, yt = nice_ticks(xlo, xhi), nice_ticks(ylo, yhi)
    ylabels = [format_tick(v, yt) for v in yt]
    left = x0 + max(text_width(t, s) for t in ylabels) + 10
    top, bottom, right = y0 + 12 * s, y1 - 14 * s - 8 - 12 * s, x1 - 8

    def px(x: float) -> int:
        return round(left + (x - xlo) / (xhi - xlo) * (right - left))

    def py(y: float) -> int:
        return round(bottom - (y - ylo) / (yhi - ylo) * (bottom - top))

    canvas.text((left + right - text_width(panel.title, s)) // 2, y0, panel.title, BLACK, s)
    for v, label in zip(yt, ylabels, strict=True):
        canvas.rect(left, py(v), right, py(v) + 1, GRID)
        canvas.rect(left - 4, py(v), left, py(v) + 1, BLACK)
        canvas.text(left - 6 - text_width(label, s), py(v) - GLYPH_H * s // 2, label, BLACK, s)
    for v in xt:
        label = format_tick(v, xt)
        canvas.rect(px(v), top, px(v) + 1, bottom, GRID)
        canvas.rect(px(v), bottom, px(v) + 1, bottom + 4, BLACK)
        canvas.text(px(v) - text_width(label, s) // 2, bottom + 7, label, BLACK, s)
    canvas.text(
        (left + right - text_width(panel.x_label, s)) // 2,
        y1 - GLYPH_H * s,
        panel.x_label,
        BLACK,
        s,
    )
    canvas.rect(left, top, left + 1, bottom + 1, BLACK)
    canvas.rect(left, bottom, right + 1, bottom + 1, BLACK)
    for sr in reversed(panel.series):  # the first series (the reference) ends up on top
        finite = [(px(x), py(y)) for x, y in sr.points if math.isfinite(x) and math.isfinite(y)]
        for (ax, ay), (bx, by) in itertools.pairwise(finite):
            canvas.line(ax, ay, bx, by, colors[sr.label], width=2)
        if len(finite) == 1:  # a lone point would draw nothing as a line
            (ax, ay), color = finite[0], colors[sr.label]
            canvas.rect(ax - 2, ay - 2, ax + 3, ay + 3, color)


def render_chart(panels: Sequence[Panel], width: int = 1100, height: int = 500) -> Canvas:
    """Panels side by side above one legend; a label keeps its color across panels."""
    labels = list(dict.fromkeys(sr.label for p in panels for sr in p.series))
    colors = {label: PALETTE[i % len(PALETTE)] for i, label in enumerate(labels)}
    s, gap, swatch = 2, 28, 18
    # Lay out the legend first, wrapping to new rows, so the panels get the remaining height.
    entries: list[tuple[int, int, str]] = []
    x, row = 16, 0
    for label in labels:
        w = swatch + 8 + text_width(label, s)
        if x + w > width - 16 and x > 16:
            x, row = 16, row + 1
        entries.append((x, row, label))
        x += w + gap
    legend_h = (row + 1) * 24 + 12 if labels else 0
    canvas = Canvas(width, height)
    n = max(1, len(panels))
    for i, panel in enumerate(panels):
        left = 16 + i * (width - 16) // n
        box = (left, 12, left + (width - 16) // n - 24, height - legend_h)
        _draw_panel(canvas, panel, box, colors)
    for x, r, label in entries:
        y = height - legend_h + 8 + r * 24
        canvas.rect(x, y, x + swatch, y + 14, colors[label])
        canvas.text(x + swatch + 8, y, label, BLACK, s)
    return canvas


def write_chart_png(
    path: str | Path, panels: Sequence[Panel], width: int = 1100, height: int = 500
) -> Path:
    """Render ``panels`` (see :func:`render_chart`) and write them to ``path`` as a PNG."""
    path = Path(path)
    path.write_bytes(render_chart(panels, width, height).png())
    return path
