"""Latency against throughput as a PNG: `lanes tune`'s picture, and the benchmarks'.

    chart = Chart(title="...", curves=[Curve("lanes", points), Curve("baseline", ...)])
    problem = plotting_missing()    # None, or what to install
    if problem is None:
        save_chart(chart, Path("latency.png"))

Each curve is one server, policy or configuration, its points in the order they were
loaded (concurrency rising): its p99 a solid line, its p50 a dashed one in the same
colour, throughput across and latency up (a log scale: a curve's knee spans a
hundredfold), each p99 marker with its point's label (the clients). A target draws a
horizontal line, and a chosen point a star.

matplotlib is an optional extra (`lanes[plot]`): nothing else imports it, and this
module imports it only inside `save_chart`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

PLOT_EXTRA = "plot"


@dataclass(frozen=True)
class CurvePoint:
    """One load level: its throughput and its latencies (None: no answer timed)."""

    throughput: float
    p50_ms: float | None
    p99_ms: float | None
    label: str = ""  # written beside its p99 marker, e.g. the clients: "x16"


@dataclass(frozen=True)
class Curve:
    name: str
    points: list[CurvePoint]


@dataclass(frozen=True)
class Chosen:
    """The point to mark, and what to call it."""

    point: CurvePoint
    label: str


@dataclass(frozen=True)
class Chart:
    title: str
    curves: list[Curve]
    throughput_unit: str = "items/s"
    latency: str = "latency"  # what is measured, e.g. "TTFT"
    target_ms: float | None = None  # a p99 target: the horizontal line
    chosen: Chosen | None = None
    note: str = ""  # a line under the title: what was run, where


def plotting_missing() -> str | None:
    """None when PNGs can be drawn; else the message that says which extra to install."""
    if importlib.util.find_spec("matplotlib") is None:
        return (
            "no PNG: drawing it needs matplotlib, which this install lacks: "
            f"pip install 'lanes[{PLOT_EXTRA}]'"
        )
    return None


def save_chart(chart: Chart, path: Path) -> Path:
    """Draw `chart` into the PNG file `path` (its folder is made); returns `path`.
    Needs matplotlib (`plotting_missing` says whether it is there)."""
    # The object API with the Agg canvas: no pyplot, so no global figure state and no
    # display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    figure = Figure(figsize=(8, 5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    colours = [f"C{i % 10}" for i in range(len(chart.curves))]
    for curve, colour in zip(chart.curves, colours, strict=True):
        for quantile, style in (("p99", "-"), ("p50", "--")):
            xs, ys = [], []
            for point in curve.points:
                value = point.p99_ms if quantile == "p99" else point.p50_ms
                if value is not None and value > 0:
                    xs.append(point.throughput)
                    ys.append(value)
            label = curve.name if quantile == "p99" else None
            axes.plot(xs, ys, style, color=colour, marker="o", markersize=3, label=label)
        for point in curve.points:
            if point.label and point.p99_ms is not None and point.p99_ms > 0:
                axes.annotate(
                    point.label,
                    xy=(point.throughput, point.p99_ms),
                    xytext=(3, 3),
                    textcoords="offset points",
                    color=colour,
                    fontsize=6,
                )
    if chart.target_ms is not None:
        axes.axhline(chart.target_ms, color="crimson", linestyle=":", linewidth=1.5)
        axes.annotate(
            f"p99 target {chart.target_ms:g} ms",
            xy=(1.0, chart.target_ms),
            xycoords=("axes fraction", "data"),
            xytext=(-4, 3),
            textcoords="offset points",
            ha="right",
            color="crimson",
            fontsize=8,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
        )
    chosen = chart.chosen
    if chosen is not None and chosen.point.p99_ms is not None:
        axes.plot(
            [chosen.point.throughput],
            [chosen.point.p99_ms],
            marker="*",
            markersize=16,
            color="gold",
            markeredgecolor="black",
            linestyle="none",
            label=chosen.label,
            zorder=5,
        )
    axes.set_yscale("log")
    # Plain numbers (20, 50, 100), not powers of ten, on a scale of a few decades.
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    axes.yaxis.set_major_formatter(plain)
    axes.yaxis.set_minor_formatter(plain)
    axes.tick_params(axis="y", which="minor", labelsize=7)
    axes.set_xlabel(f"throughput ({chart.throughput_unit})")
    axes.set_ylabel(f"{chart.latency} (ms): p99 solid, p50 dashed")
    axes.grid(True, which="both", alpha=0.25)
    axes.legend(fontsize=7, loc="best", ncols=2 if len(chart.curves) > 4 else 1)
    figure.suptitle(chart.title, fontsize=11)
    if chart.note:
        axes.set_title(chart.note, fontsize=8, color="dimgray")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path
