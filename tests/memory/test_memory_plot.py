"""The memory figures' layout, on the committed reports: no legend covers a data point (the N = 1 point
sat under the old per-axes legend of reports/cpu/memory-E32.png), nothing runs past the figure."""
import json
import os

import pytest
from tests.helpers.tiers import dev_first

pytest.importorskip("matplotlib")
from benchmarks import memory_modes_report  # noqa: E402
from verify.memory import plot  # noqa: E402

FIGURES = {"peaks_figure": plot.peaks_figure, "modes_figure": memory_modes_report.modes_figure}

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def layout_problems(fig) -> list[str]:
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    fb = fig.bbox
    inside = lambda b: b.x0 >= fb.x0 - 1 and b.x1 <= fb.x1 + 1 and b.y0 >= fb.y0 - 1 and b.y1 <= fb.y1 + 1  # noqa: E731
    problems, points = [], []
    for ax in fig.axes:
        for line in ax.get_lines():
            points += [tuple(ax.transData.transform(xy)) for xy in line.get_xydata() if xy[1] == xy[1]]
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    for leg in legends:
        b = leg.get_window_extent(r)
        covered = [p for p in points if b.x0 <= p[0] <= b.x1 and b.y0 <= p[1] <= b.y1]
        if covered:
            problems.append(f"a legend covers {len(covered)} data point(s), e.g. at {covered[0]}")
        if not inside(b):
            problems.append(f"a legend runs past the figure: {b} vs {fb}")
        if leg in fig.legends and any(b.overlaps(ax.bbox) for ax in fig.axes):
            problems.append("the figure legend overlaps a panel")
    texts = [t for ax in fig.axes for t in (ax.title, ax.xaxis.label, ax.yaxis.label)]
    texts += [t for leg in legends for t in leg.get_texts()] + ([fig._suptitle] if fig._suptitle else [])
    problems += [f"text {t.get_text()[:40]!r} runs past the figure" for t in texts if not inside(t.get_window_extent(r))]
    return problems


@pytest.mark.parametrize("figure,path", [("peaks_figure", "reports/cpu/memory-E32.json"),
                                         ("modes_figure", "reports/cpu/memory-modes-cpu.json"),
                                         *dev_first([("peaks_figure", "reports/h200/memory-E32.json"),
                                                     ("modes_figure", "reports/h200x2/memory-modes/memory-modes-cuda.json")],
                                                    dev=0)])
def test_figure_legend_covers_no_point(figure, path):
    with open(os.path.join(ROOT, path)) as f:
        fig = FIGURES[figure](json.load(f))
    try:
        assert layout_problems(fig) == [], path
    finally:
        plot.to_png(fig)  # closes it


def test_the_check_can_fail():
    """A legend placed on the data (matplotlib's 'best' has no free corner here) is reported."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot(range(40), [i % 7 for i in range(40)], "o", label="a label long enough to sit on the points")
    ax.legend(loc="center")
    try:
        assert any("covers" in p for p in layout_problems(fig))
    finally:
        plot.to_png(fig)
