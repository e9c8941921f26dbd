"""Small inline SVG charts for the benchmark report (no plotting dependency).

Four shapes cover the reports: grouped horizontal bars with min–max whiskers,
stacked horizontal bars, line charts with whiskers, and a map of which series
wins in each cell of a grid (the sweep's). Every function returns
one self-contained ``<svg>`` string; labels are escaped here. Charts are drawn
``CHART_W`` wide, the report page's text width (the page scales them down on a
narrower window), and the value labels of one chart share one precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Callable, Optional, Union

PALETTE = ("#4878d0", "#ee854a", "#6acc64", "#d65f5f", "#956cb4", "#8c613c", "#dc7ec0", "#797979")
FONT = 'font-family="system-ui, sans-serif" font-size="12"'
CHART_W, ROW_H, PAD, GROUP_GAP, CHAR_W, LEGEND_ROW = 1180, 18, 12, 6, 6.8, 16
LINE_H = 300  # plot height of a line chart
SMALL_FONT = 'font-family="system-ui, sans-serif" font-size="10"'
MAP_LINE, MAP_SMALL_LINE = 16, 13  # text line heights in a map cell


@dataclass(frozen=True)
class Bar:
    """One bar: ``series`` picks its colour; ``low``/``high`` draw a whisker."""

    label: str
    series: str
    value: float
    low: Optional[float] = None
    high: Optional[float] = None


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    low: Optional[float] = None
    high: Optional[float] = None


@dataclass(frozen=True)
class Cell:
    """One cell of :func:`grid_map`: its column and row, the series that won
    it (None: none did), and each series' value, or a word where it has none
    (e.g. "OOM")."""

    column: str
    row: str
    winner: Optional[str]
    values: dict[str, Union[float, str]]


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``top``."""
    if top <= 0 or not math.isfinite(top):
        return [0.0, 1.0]
    raw = top / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [round(i * step, 12) for i in range(int(math.ceil(top / step - 1e-9)) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def value_formatter(values: list[float]):
    """One format for every value label of a chart: three significant digits
    of the largest value (0.326 and 0.320; 46 and 3,488), at most 3 decimals."""
    top = max([abs(v) for v in values if math.isfinite(v)] or [0.0])
    decimals = 3 if top == 0 else min(max(2 - math.floor(math.log10(top)), 0), 3)
    return lambda v: f"{v:,.{decimals}f}"


def _text_w(text: str) -> float:
    """About how wide ``text`` renders at the chart font (no font metrics here)."""
    return len(text) * CHAR_W


def _label_w(labels: list[str]) -> float:
    return max([_text_w(t) for t in labels] or [0.0]) + 2 * PAD


def _legend(series: list[str], x: float, y: float, width: float) -> tuple[list[str], float]:
    """Coloured keys left to right, wrapping at ``width``; returns the elements
    and the height they take."""
    out, cx, rows = [], x, 1
    for i, name in enumerate(series):
        w = _text_w(name) + 30
        if cx > x and cx + w > x + width:
            cx, rows = x, rows + 1
        cy = y + (rows - 1) * LEGEND_ROW
        out.append(f'<rect x="{cx:.0f}" y="{cy - 9}" width="10" height="10" fill="{PALETTE[i % len(PALETTE)]}"/>')
        out.append(f'<text x="{cx + 14:.0f}" y="{cy}" {FONT}>{escape(name)}</text>')
        cx += w
    return out, rows * LEGEND_ROW


def _svg(width: float, height: float, title: str, body: list[str]) -> str:
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{escape(title)}">'
    )
    heading = f'<text x="{PAD}" y="16" {FONT} font-weight="bold">{escape(title)}</text>'
    return "\n".join([head, heading, *body, "</svg>"])


def hbar_chart(bars: list[Bar], title: str, unit: str) -> str:
    """Horizontal bars, one row per bar, coloured by series, with min–max whiskers."""
    series = list(dict.fromkeys(b.series for b in bars))
    top = max([b.high if b.high is not None else b.value for b in bars] or [1.0])
    ticks = nice_ticks(top)
    fmt = value_formatter([b.value for b in bars])
    x0 = _label_w([b.label for b in bars])
    bar_w = CHART_W - x0 - _label_w([fmt(b.value) for b in bars])
    scale = bar_w / ticks[-1]
    body, legend_h = _legend(series, x0, 32, bar_w) if len(series) > 1 else ([], 0)
    y = 32 + legend_h - ROW_H
    for i, b in enumerate(bars):
        first = i == 0 or bars[i - 1].label != b.label  # a group's label is written once
        y += ROW_H + (GROUP_GAP if first and i else 0)
        color = PALETTE[series.index(b.series) % len(PALETTE)]
        if first:
            body.append(f'<text x="{x0 - 6}" y="{y + 12}" {FONT} text-anchor="end">{escape(b.label)}</text>')
        body.append(
            f'<rect x="{x0}" y="{y + 2}" width="{max(b.value, 0) * scale:.1f}" height="{ROW_H - 5}" '
            f'fill="{color}"><title>{escape(b.label)}: {_fmt(b.value)} {escape(unit)}</title></rect>'
        )
        if b.low is not None and b.high is not None:
            lo, hi, mid = x0 + b.low * scale, x0 + b.high * scale, y + ROW_H / 2
            body.append(
                f'<path d="M{lo:.1f} {mid:.1f}H{hi:.1f}M{lo:.1f} {mid - 4:.1f}V{mid + 4:.1f}'
                f'M{hi:.1f} {mid - 4:.1f}V{mid + 4:.1f}" stroke="#222" fill="none"/>'
            )
        end = x0 + max(b.high if b.high is not None else b.value, b.value) * scale
        body.append(f'<text x="{end + 4:.1f}" y="{y + 12}" {FONT} fill="#333">{fmt(b.value)}</text>')
    y_axis = y + ROW_H + 4
    body += _x_axis(ticks, scale, x0, y_axis, unit)
    return _svg(CHART_W, y_axis + 36, title, body)


def _x_axis(ticks: list[float], scale: float, x0: float, y: float, unit: str) -> list[str]:
    out = [f'<path d="M{x0} {y}H{x0 + ticks[-1] * scale:.1f}" stroke="#888"/>']
    for t in ticks:
        x = x0 + t * scale
        out.append(f'<path d="M{x:.1f} {y}V{y + 4}" stroke="#888"/>')
        out.append(f'<text x="{x:.1f}" y="{y + 16}" {FONT} text-anchor="middle">{_fmt(t)}</text>')
    out.append(
        f'<text x="{x0 + ticks[-1] * scale / 2:.1f}" y="{y + 30}" {FONT} text-anchor="middle">{escape(unit)}</text>'
    )
    return out


def stacked_hbar_chart(rows: list[tuple[str, list[float]]], parts: list[str], title: str, unit: str) -> str:
    """Horizontal bars split into ``parts`` (e.g. I/O wait + everything else)."""
    top = max([sum(v) for _, v in rows] or [1.0])
    ticks = nice_ticks(top)
    fmt = value_formatter([v for _, values in rows for v in values])
    totals = [" + ".join(map(fmt, values)) for _, values in rows]
    x0 = _label_w([label for label, _ in rows])
    bar_w = CHART_W - x0 - _label_w(totals)
    scale = bar_w / ticks[-1]
    body, legend_h = _legend(parts, x0, 32, bar_w)
    y0 = 32 + legend_h
    for i, (label, values) in enumerate(rows):
        y, x = y0 + i * ROW_H, x0
        body.append(f'<text x="{x0 - 6}" y="{y + 12}" {FONT} text-anchor="end">{escape(label)}</text>')
        for j, v in enumerate(values):
            w = max(v, 0) * scale
            body.append(
                f'<rect x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{ROW_H - 5}" '
                f'fill="{PALETTE[j % len(PALETTE)]}"><title>{escape(parts[j])}: {_fmt(v)} '
                f"{escape(unit)}</title></rect>"
            )
            x += w
        body.append(f'<text x="{x + 4:.1f}" y="{y + 12}" {FONT} fill="#333">{totals[i]}</text>')
    y_axis = y0 + len(rows) * ROW_H + 4
    body += _x_axis(ticks, scale, x0, y_axis, unit)
    return _svg(CHART_W, y_axis + 36, title, body)


def line_chart(series: dict[str, list[Point]], title: str, x_label: str, y_label: str) -> str:
    """One line per series over numeric x, with min–max whiskers where given."""
    points = [p for ps in series.values() for p in ps]
    if not points:
        return _svg(CHART_W, 40, title, [])
    left = 60
    w, h = CHART_W - left - 30, LINE_H
    body, legend_h = _legend(list(series), left, 32, w)
    top_y = 32 + legend_h + 8
    x_ticks = nice_ticks(max(p.x for p in points) or 1.0)
    y_ticks = nice_ticks(max(p.high if p.high is not None else p.y for p in points))
    sx, sy = w / x_ticks[-1], h / y_ticks[-1]

    def at(x: float, y: float) -> tuple[float, float]:
        return left + x * sx, top_y + h - y * sy

    for t in y_ticks:
        _, y = at(0, t)
        body.append(f'<path d="M{left} {y:.1f}H{left + w}" stroke="#eee"/>')
        body.append(f'<text x="{left - 6}" y="{y + 4:.1f}" {FONT} text-anchor="end">{_fmt(t)}</text>')
    for t in x_ticks:
        x, y = at(t, 0)
        body.append(f'<path d="M{x:.1f} {y}V{y + 4}" stroke="#888"/>')
        body.append(f'<text x="{x:.1f}" y="{y + 16}" {FONT} text-anchor="middle">{_fmt(t)}</text>')
    body.append(f'<path d="M{left} {top_y}V{top_y + h}H{left + w}" stroke="#888" fill="none"/>')
    body.append(f'<text x="{left + w / 2}" y="{top_y + h + 32}" {FONT} text-anchor="middle">{escape(x_label)}</text>')
    body.append(
        f'<text x="14" y="{top_y + h / 2}" {FONT} text-anchor="middle" '
        f'transform="rotate(-90 14 {top_y + h / 2})">{escape(y_label)}</text>'
    )
    for i, (name, ps) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        ps = sorted(ps, key=lambda p: p.x)
        path = " ".join(
            f"{'M' if j == 0 else 'L'}{at(p.x, p.y)[0]:.1f} {at(p.x, p.y)[1]:.1f}" for j, p in enumerate(ps)
        )
        body.append(f'<path d="{path}" stroke="{color}" stroke-width="2" fill="none"/>')
        for p in ps:
            x, y = at(p.x, p.y)
            body.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}">'
                f"<title>{escape(name)} @ {_fmt(p.x)}: {_fmt(p.y)}</title></circle>"
            )
            if p.low is not None and p.high is not None:
                _, lo = at(p.x, p.low)
                _, hi = at(p.x, p.high)
                body.append(
                    f'<path d="M{x:.1f} {lo:.1f}V{hi:.1f}M{x - 3:.1f} {lo:.1f}H{x + 3:.1f}'
                    f'M{x - 3:.1f} {hi:.1f}H{x + 3:.1f}" stroke="{color}" fill="none"/>'
                )
    return _svg(CHART_W, top_y + h + 44, title, body)


def grid_map(
    cells: list[Cell], columns: list[str], rows: list[str], series: list[str], title: str, x_label: str,
    y_label: str, unit: str,
) -> str:  # fmt: skip
    """A grid of cells, ``columns`` left to right and ``rows`` bottom to top
    in the order given, each filled with its winner's legend colour and
    labelled with the winner and its value, every other series' value (or
    word) below it in small text, in ``series`` order."""
    fmt = value_formatter([v for c in cells for v in c.values.values() if not isinstance(v, str)])

    def shown(v: Union[float, str]) -> str:  # one precision for the chart; words as they are
        return v if isinstance(v, str) else fmt(v)

    left = 28 + _label_w(rows)
    cell_w = (CHART_W - left - PAD) / max(len(columns), 1)
    cell_h = 2 * MAP_LINE + max(len(series) - 1, 0) * MAP_SMALL_LINE + 14
    cell_h = max(cell_h, (_text_w(y_label) + 2 * PAD) / max(len(rows), 1))  # room for the rotated y label
    body, legend_h = _legend(series, left, 32, CHART_W - left - PAD)
    top_y = 32 + legend_h + 8
    grid_h = len(rows) * cell_h
    for i, row in enumerate(rows):  # the first row at the bottom
        y = top_y + (len(rows) - 1 - i) * cell_h
        body.append(
            f'<text x="{left - 6:.0f}" y="{y + cell_h / 2 + 4:.1f}" {FONT} text-anchor="end">{escape(row)}</text>'
        )
    for j, column in enumerate(columns):
        x = left + (j + 0.5) * cell_w
        body.append(
            f'<text x="{x:.1f}" y="{top_y + grid_h + 16:.1f}" {FONT} text-anchor="middle">{escape(column)}</text>'
        )
    for c in cells:
        x, y = left + columns.index(c.column) * cell_w, top_y + (len(rows) - 1 - rows.index(c.row)) * cell_h
        body += _map_cell(c, x, y, cell_w, cell_h, series, shown, unit)
    body.append(
        f'<text x="{left + (CHART_W - left - PAD) / 2:.1f}" y="{top_y + grid_h + 32:.1f}" {FONT} '
        f'text-anchor="middle">{escape(x_label)}</text>'
    )
    body.append(
        f'<text x="14" y="{top_y + grid_h / 2:.1f}" {FONT} text-anchor="middle" '
        f'transform="rotate(-90 14 {top_y + grid_h / 2:.1f})">{escape(y_label)}</text>'
    )
    return _svg(CHART_W, top_y + grid_h + 44, title, body)


def _map_cell(
    c: Cell, x: float, y: float, w: float, h: float, series: list[str], shown: Callable[[Union[float, str]], str],
    unit: str,
) -> list[str]:  # fmt: skip
    """One map cell: filled with the winner's colour (grey without one), the
    winner and its value, then every other series' value in small text."""
    if c.winner is not None:
        color, head = PALETTE[series.index(c.winner) % len(PALETTE)], [c.winner, f"{shown(c.values[c.winner])} {unit}"]
    else:
        words = set(c.values.values())  # "all OOM" where every series has that one word
        only = words.pop() if len(words) == 1 else None
        color, head = "#eeeeee", [f"all {only}" if isinstance(only, str) else "no winner"]
    others = [f"{name}: {shown(c.values[name])}" for name in series if name != c.winner and name in c.values]
    lines = [(head[0], f'{FONT} font-weight="bold"', MAP_LINE)] + [(t, FONT, 2 * MAP_LINE) for t in head[1:]]
    lines += [(t, f'{SMALL_FONT} fill="#333"', 2 * MAP_LINE + (k + 1) * MAP_SMALL_LINE) for k, t in enumerate(others)]
    out = [
        f"<g><title>{escape(f'{c.row}, {c.column}: ' + ' at '.join(head))}</title>",
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{color}" fill-opacity="0.35" '
        'stroke="#fff" stroke-width="2"/>',
    ]
    out += [f'<text x="{x + w / 2:.1f}" y="{y + dy + 2:.1f}" {font} text-anchor="middle">{escape(text)}</text>'
            for text, font, dy in lines]  # fmt: skip
    return out + ["</g>"]
