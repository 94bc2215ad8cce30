"""docs/planning.md's comparison with arXiv 2501.18512 is what results/plan-published holds."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "results/plan-published"
DOC_NAMES = {
    "Data-Parallel": "data-parallel", "Vanilla DiLoCo": "diloco",
    "Vanilla DiLoCo, sync after the step": "diloco-after-step",
    "Streaming DiLoCo": "streaming", "Streaming DiLoCo, sync after the step":
    "streaming-after-step", "Streaming DiLoCo, contiguous fragments": "streaming-contiguous",
    "w/ overlapped com.": "streaming-overlap", "w/ overlapped FP4 com.": "streaming-overlap-fp4",
}


def _compare():
    """results/plan-published/compare.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("plan_published_compare", HERE / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _doc_rows() -> list[list[str]]:
    """The cells of the Table 4 comparison rows of docs/planning.md."""
    text = (ROOT / "docs/planning.md").read_text()
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if re.match(r"^\| (1|10|100)B \|", line)]


def test_every_table_4_figure_of_the_docs_comes_from_the_committed_plans():
    compare = _compare()
    paper = pd.read_csv(HERE / "paper_table4.csv")
    rows = _doc_rows()
    assert len(rows) == 24  # 3 sizes x (5 methods + 3 variants)
    for size, method, *cells in rows:
        name = DOC_NAMES[method]
        base = next(b for b, variants in {**compare.VARIANTS, name: []}.items()
                    if name == b or name in variants)
        theirs = paper[(paper["size"] == size.lower()) & (paper["method"] == base)].iloc[0]
        ours = pd.read_csv(HERE / f"{size.lower()}-{name}.csv")
        for target, cell in zip(compare.TARGETS, cells, strict=True):
            point, _ = compare.first_reaching(ours, target)
            paper_figure = theirs[f"cu{round(target * 100)}"]
            if point is None:
                assert cell == f"{paper_figure} / not reached", (size, method, target)
                continue
            steps = round(compare.grid_index(point) - compare.grid_index(paper_figure))
            steps_text = "0" if steps == 0 else f"{steps:+d}"
            assert cell == f"{paper_figure} / {point:.3g} ({steps_text})", (size, method, target)


def test_the_table_1_figures_of_the_docs_come_from_the_committed_plans():
    text = (ROOT / "docs/planning.md").read_text()
    for method, doc in (("data-parallel", "Data-Parallel"),
                        ("streaming-overlap-fp4", "w/ overlapped FP4 com.")):
        ours = pd.read_csv(HERE / f"1b-{method}-1gbit.csv").iloc[0]
        assert ours["inter_bw"] == "1Gbit"
        row = next(line for line in text.splitlines() if line.startswith(f"| {doc} | "))
        utilization, ratio = row.strip("|").split("|")[1:3]
        assert utilization.strip().endswith(f"/ {ours['compute_utilization']:.1%}")
        assert ratio.strip().endswith(f"/ {ours['step_time_s'] / ours['compute_s']:.4g}")


def test_the_counts_and_fits_the_docs_give_for_both_readings_come_from_compare():
    compare = _compare()
    text = " ".join((ROOT / "docs/planning.md").read_text().split())
    assert f"in {compare.within_one_step(0)} of the 75 figures" in text
    assert f"within one grid step in {compare.within_one_step(1)} of the 75" in text
    printed, lower = compare.equal_layer_factors(0), compare.equal_layer_factors(1)
    assert printed[:2] == lower[:2] == (29, 30)
    assert printed[4] == lower[4] == ["10b data-parallel 99%"]
    assert f"read as printed, {printed[2]:.3f}-{printed[3]:.3f};" in text
    assert f"read one grid step lower, {lower[2]:.3f}-{lower[3]:.3f}." in text
    low, high = compare.table1_factors()
    assert f"put {low:.3f}-{high:.3f} times the plan's bytes" in text


def test_the_readme_gives_the_same_counts():
    compare = _compare()
    text = " ".join((ROOT / "README.md").read_text().split())
    assert (f"in {compare.within_one_step(0)} of its 75 figures as printed and in "
            f"{compare.within_one_step(1)} of 75 read one grid step lower") in text
