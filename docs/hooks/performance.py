"""The Performance page's measurements, each rendered as a table and an SVG chart at build time.

The numbers are copied from the dated measurement log (docs/development/benchmarks.md, the section
named in each `Measurement.sources`); the page shows them as a table (the numbers) next to a chart
(the question). The charts are plain SVG drawn in `currentColor`, so they follow the site's light or
dark palette, and scale to the page's width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

DPFEDAVG, DPFEDAVG_2 = "#4e79a7", "#76b7b2"
FLOWER, FLOWER_2 = "#f28e2b", "#e15759"
OTHER, OTHER_2 = "#b07aa1", "#9c755f"


@dataclass(frozen=True)
class Series:
    """One line (x, y points) or one bar (a single value) of a chart."""

    label: str
    points: tuple[tuple[float, float], ...]
    color: str = DPFEDAVG


@dataclass(frozen=True)
class Measurement:
    """One question: a chart of `series`, a table with `columns`, and where the numbers come from."""

    title: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...]
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    sources: tuple[tuple[str, str], ...]  # (title, anchor) of the log's sections
    kind: str = "line"  # "line": log-log lines over x; "bar": one horizontal bar per series
    unit: str = ""


SCALE = Measurement(
    title="Seconds per round against the number of clients n (20% sampled per round)",
    xlabel="clients n",
    ylabel="seconds per round",
    series=(
        Series("batched engine", ((100, 0.059), (1000, 0.133), (5000, 0.35)), DPFEDAVG),
        Series("Flower simulation, 20 SuperNodes (recommended)", ((100, 0.215), (1000, 0.337), (5000, 0.862)), FLOWER),
        Series("Flower simulation, one SuperNode per client", ((100, 0.224), (1000, 1.83), (5000, 9.89)), FLOWER_2),
    ),
    columns=("n", "sampled per round", "batched engine", "Flower, 20 SuperNodes", "Flower, one SuperNode per client"),
    rows=(
        ("100", "20", "0.059 s", "0.215 s", "0.224 s"),
        ("1000", "200", "0.133 s", "0.337 s", "1.83 s"),
        ("5000", "1000", "**0.35 s**", "**0.86 s**", "9.89 s"),
    ),
    sources=(
        ("Scale: three engines", "scale-three-engines-at-n-100-1000-5000"),
        ("Flower simulation with virtual clients", "flower-simulation-with-virtual-clients"),
    ),
)

PFL = Measurement(
    title="Seconds per round, n = 3000, 600 clients per round, the same model (2026-11-28)",
    xlabel="seconds per round (shorter is faster)",
    ylabel="",
    kind="bar",
    unit="s",
    series=(
        Series("dpfedavg, torch-compile = true", ((0, 0.185),), DPFEDAVG),
        Series("dpfedavg (torch.func, eager)", ((0, 0.274),), DPFEDAVG_2),
        Series("pfl-research, 2 processes", ((0, 0.835),), OTHER),
        Series("pfl-research, 1 process", ((0, 1.889),), OTHER_2),
    ),
    columns=("library", "seconds per round", "relative to dpfedavg (compiled)"),
    rows=(
        ("dpfedavg, `nn.Linear(784, 10)`, `torch-compile = true`", "**0.185**", "1x"),
        ("dpfedavg, `nn.Linear(784, 10)`, eager (the default)", "0.274", "half again as slow"),
        ("pfl-research 0.6.0, 2 processes", "0.835", "4.5x slower"),
        ("pfl-research 0.6.0, 1 process", "1.889", "about 10 times slower"),
    ),
    sources=(
        ("Against pfl-research (six runs, 3.9x to 4.5x; the last shown, rounds 2-12 on both sides)",
         "the-compiled-local-steps-and-a-float32-pipeline-against-pfl-research-issue-49-2026-11-28"),
    ),
)

FLOWER_DP = Measurement(
    title="Test accuracy after 15 rounds at the same (8, 1e-5)-DP",
    xlabel="test accuracy (mean of 3 seeds)",
    ylabel="",
    kind="bar",
    series=(
        Series("Flower's DP wrapper (fixed clipping)", ((0, 0.439),), FLOWER),
        Series("dpfedavg, DP-FedAvg (clip)", ((0, 0.847),), DPFEDAVG_2),
        Series("dpfedavg, DP-NormFedAvg (norm)", ((0, 0.909),), DPFEDAVG),
    ),
    columns=("strategy", "noise multiplier z", "accuracy (min-max)", "seconds per round"),
    rows=(
        ("Flower's `DifferentialPrivacyServerSideFixedClipping`", "2.472", "0.439 (0.377-0.542)", "0.20"),
        ("dpfedavg, DP-FedAvg (`clip`, server noise)", "1.392", "0.847 (0.827-0.869)", "0.20"),
        ("dpfedavg, DP-NormFedAvg (`norm`, the example)", "1.392", "**0.909** (0.888-0.931)", "0.26"),
    ),
    sources=(("DP for a Flower app", "dp-for-a-flower-app-side-by-side-with-flowers-wrapper"),),
)

MEASUREMENTS = {"scale": SCALE, "pfl": PFL, "flower-dp": FLOWER_DP}

W, H = 640, 380
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 16, 48


def _ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks between lo and hi (log axis)."""
    out = []
    for k in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1):
        for m in (1, 2, 5):
            v = m * 10.0**k
            if lo <= v * 1.0000001 and v <= hi * 1.0000001:
                out.append(v)
    return out


def _num(v: float) -> str:
    return f"{v:g}"


def _legend(series: tuple[Series, ...], y0: float) -> list[str]:
    parts = []
    for i, s in enumerate(series):
        y = y0 + 20 * i
        parts.append(f'<rect x="{LEFT + 12}" y="{y - 9}" width="14" height="4" fill="{s.color}" stroke="none"/>')
        parts.append(f'<text x="{LEFT + 32}" y="{y - 3}" font-size="14">{escape(s.label)}</text>')
    return parts


def line_chart(m: Measurement) -> list[str]:
    """Log-log lines of seconds against clients, one per series, under a legend."""
    top = TOP + 20 * len(m.series) + 10
    xs = [x for s in m.series for x, _ in s.points]
    ys = [y for s in m.series for _, y in s.points]
    x0, x1 = math.log10(min(xs)), math.log10(max(xs))
    ylo, yhi = min(ys) / 1.5, max(ys) * 1.5
    y0, y1 = math.log10(ylo), math.log10(yhi)

    def px(x: float) -> float:
        return LEFT + (math.log10(x) - x0) / (x1 - x0) * (W - LEFT - RIGHT - 20) + 10

    def py(y: float) -> float:
        return H - BOTTOM - (math.log10(y) - y0) / (y1 - y0) * (H - top - BOTTOM)

    parts = []
    for t in _ticks(ylo, yhi):
        parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke-opacity=".15"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{py(t) + 4:.1f}" text-anchor="end" font-size="14">{_num(t)}</text>')
    for x in sorted(set(xs)):
        parts.append(f'<text x="{px(x):.1f}" y="{H - BOTTOM + 18}" text-anchor="middle" font-size="14">{x:g}</text>')
    parts.append(
        f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 10}" text-anchor="middle" font-size="15">{escape(m.xlabel)}</text>'
    )
    parts.append(
        f'<text transform="translate(16 {(top + H - BOTTOM) / 2}) rotate(-90)" text-anchor="middle" '
        f'font-size="15">{escape(m.ylabel)} (log scale)</text>'
    )
    for s in m.series:
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{s.color}" stroke-width="2.5"/>')
        for x, y in s.points:
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="4" fill="{s.color}" stroke="none"/>')
    return parts + _legend(m.series, TOP + 14)  # above the plot area


def bar_chart(m: Measurement) -> list[str]:
    """One horizontal bar per series, labelled with its value, on a linear axis from 0."""
    top = max(y for s in m.series for _, y in s.points) * 1.15
    label_w = 270
    height = 40 * len(m.series)

    def px(v: float) -> float:
        return label_w + v / top * (W - label_w - RIGHT - 40)

    parts = []
    for i, s in enumerate(m.series):
        value = s.points[0][1]
        y = TOP + 40 * i
        parts.append(f'<text x="{label_w - 8}" y="{y + 19}" text-anchor="end" font-size="14">{escape(s.label)}</text>')
        parts.append(
            f'<rect x="{label_w}" y="{y + 5}" width="{px(value) - label_w:.1f}" height="22" fill="{s.color}" '
            'stroke="none"/>'
        )
        parts.append(f'<text x="{px(value) + 6:.1f}" y="{y + 20}" font-size="14">{_num(value)} {m.unit}</text>')
    parts.append(f'<line x1="{label_w}" x2="{label_w}" y1="{TOP}" y2="{TOP + height}" stroke-opacity=".5"/>')
    parts.append(
        f'<text x="{(label_w + W - RIGHT) / 2}" y="{TOP + height + 24}" text-anchor="middle" '
        f'font-size="15">{escape(m.xlabel)}</text>'
    )
    return parts


def chart(m: Measurement) -> str:
    """The chart of one measurement, as an inline SVG figure on one line (raw HTML in Markdown)."""
    parts = line_chart(m) if m.kind == "line" else bar_chart(m)
    height = H if m.kind == "line" else TOP + 40 * len(m.series) + 40
    svg = (
        f'<svg class="dp-chart" viewBox="0 0 {W} {height}" role="img" aria-label="{escape(m.title)}" '
        'xmlns="http://www.w3.org/2000/svg" fill="currentColor" stroke="currentColor" stroke-width="1" '
        f'font-family="inherit">{"".join(p for p in parts if not p.startswith("<text"))}'
        f'<g stroke="none">{"".join(p for p in parts if p.startswith("<text"))}</g></svg>'
    )
    return f'<figure class="dp-figure">{svg}<figcaption>{escape(m.title)}</figcaption></figure>'


def table(m: Measurement) -> str:
    lines = ["| " + " | ".join(m.columns) + " |", "|" + "---|" * len(m.columns)]
    lines += ["| " + " | ".join(row) + " |" for row in m.rows]
    return "\n".join(lines)


def generate(name: str) -> str:
    """The chart, then the table, of the measurement called `name`."""
    if name not in MEASUREMENTS:
        raise ValueError(f"unknown measurement {name!r}; known: {', '.join(MEASUREMENTS)}")
    m = MEASUREMENTS[name]
    links = ", ".join(f"[{title}](development/benchmarks.md#{anchor})" for title, anchor in m.sources)
    return f"{chart(m)}\n\n{table(m)}\n\n*From the measurement log: {links}.*"
