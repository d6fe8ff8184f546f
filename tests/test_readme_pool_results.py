"""The README's pooled-game results tables are the committed cells' own numbers.

The README quotes two experiments, each between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``:
credit-pool (per credit mode the mean pool recall with each seed's value, the difference from
the equal budget, the served nDCG@10 and the duplicate rate) and feedback-pool-v2 (the baselines,
the start and each credit mode: pool recall, served nDCG@10, degenerate rewrites); how many
cells are in, then the pre-registered comparisons. Cells land one at a time over many runs, so
this checks every number of those tables against the files in docs/experiments/NAME/ (the
cells, 4 decimals, 3 for rates; the comparisons, the aggregate's table.md): a cell committed
without its README update, or a README number typed by hand, fails here."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "docs" / "experiments"
POOL = EXPERIMENTS / "credit-pool" / "pool"
PLANNED = {"credit-pool": (30, 6), "feedback-pool-v2": (6, 3)}  # cells, seeds
LABELS = {"broadcast": "broadcast", "shuffled (placebo)": "shuffled", "singleton": "singleton",
          "leave_one_out": "leave_one_out", "shapley": "shapley"}  # fmt: skip


def _section(name: str = "credit-pool") -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(rf"<!-- {name}:begin -->(.*?)<!-- {name}:end -->", text, re.S)
    assert match is not None, f"README.md has no {name} section"
    return match.group(1)


def _cells(folder: Path = POOL) -> dict[tuple[str, int], dict]:
    cells = {}
    for path in folder.glob("*-seed*.json"):
        data = json.loads(path.read_text(encoding="utf-8"))
        cells[data["mode"], int(data["seed"])] = data
    return cells


def _num(text: str) -> float:
    return float(text.strip().replace("−", "-"))


def _cols(line: str) -> list[str]:
    """The cells of one markdown table row."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _rows(section: str) -> dict[str, list[str]]:
    rows = {}
    for line in section.splitlines():
        cols = _cols(line)
        if line.startswith("|") and cols[0] in (*LABELS, "the start"):
            rows[cols[0]] = cols
    return rows


@pytest.mark.parametrize("name", PLANNED)
def test_the_readme_counts_the_committed_cells(name: str) -> None:
    section, cells = _section(name), _cells(EXPERIMENTS / name / "pool")
    planned = PLANNED[name][0]
    complete = re.search(r"(\d+) of (\d+) cells", section)
    if complete is None:  # the finished experiment: every planned cell is in
        assert len(cells) == planned
        return
    assert (int(complete[1]), int(complete[2])) == (len(cells), planned)


def test_the_readme_table_is_the_cells_numbers() -> None:
    section, cells = _section(), _cells()
    header = re.search(r"pool recall, mean \(seeds? ([0-9, ]+)\)", section)
    assert header is not None, "the table's header names its seeds"
    seeds = [int(s) for s in header[1].split(",")]
    assert seeds == sorted({s for _, s in cells}), "the header names every seed with a cell"
    starts = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(POOL.glob("start-*.json"))]
    budget = statistics.fmean(starts[0]["budget_recall"])  # the query alone: any start's
    rows = _rows(section)
    assert set(rows) == {*LABELS, "the start"}
    for label, mode in LABELS.items():
        cols = rows[label]
        got = [cells.get((mode, s)) for s in seeds]
        per = [None if c is None else statistics.fmean(c["pool_recall"]) for c in got]
        done = [c for c in got if c is not None]
        mean = statistics.fmean(p for p in per if p is not None)
        shown = "{:.4f} ({})".format(mean, ", ".join("—" if p is None else f"{p:.4f}" for p in per))
        assert cols[1] == shown, label
        assert _num(cols[2]) == pytest.approx(round(mean - budget, 4), abs=1e-9), label
        served = statistics.fmean(statistics.fmean(c["ndcg@10"]) for c in done)
        assert cols[3] == f"{served:.4f}", label
        dup = statistics.fmean(c["eval_metrics"]["duplicate_rate"] for c in done)
        assert cols[4] == f"{dup:.3f}", label
    cols = rows["the start"]  # one row for every start: they agree at the table's precision
    for start in starts:
        assert f"{statistics.fmean(start['budget_recall']):.4f}" == f"{budget:.4f}"
        pool = statistics.fmean(start["pool_recall"])
        assert cols[1] == f"{pool:.4f}"
        assert _num(cols[2]) == pytest.approx(round(pool - budget, 4), abs=1e-9)
        assert cols[3] == f"{statistics.fmean(start['ndcg@10']):.4f}"
        assert cols[4] == f"{start['eval_metrics']['duplicate_rate']:.3f}"


def _minus(text: str) -> str:
    return text.replace("−", "-")


@pytest.mark.parametrize("name", PLANNED)
def test_the_readme_hypotheses_are_the_aggregates(name: str) -> None:
    """Each pre-registered comparison the README quotes (per-seed differences, the mean with its
    CI, p and Holm p, the verdict) is the row of the committed ``table.md`` that
    `casi experiment aggregate` wrote from the cells (which another test rebuilds byte for byte):
    a verdict ("held" / "not held") only once no planned seed is missing, "not yet" before; a
    comparison with no seed yet is left out."""
    section = _section(name)
    table = (EXPERIMENTS / name / "table.md").read_text(encoding="utf-8")
    comparison = re.compile(r"\| \w+ [>≠≈] \w+")  # "| shapley > broadcast …"
    rows = [_cols(line) for line in table.splitlines() if comparison.match(line)]
    tested = [row for row in rows if row[2] != "0"]  # the seeds column
    header = re.search(r"\| hypothesis \| per seed \(A − B; seeds? ([0-9, ]+)\)", section)
    assert header is not None, "the README quotes the pre-registered comparisons"
    shown = [_cols(line) for line in section.splitlines() if comparison.match(line)]
    assert len(shown) == len(tested) > 0
    planned = [int(s) for s in header[1].split(",")]
    assert planned == list(range(PLANNED[name][1])), "one place per planned seed"
    for got, row in zip(shown, tested, strict=True):
        label, family, _, diff, ci, p, holm, _, per_seed, _, held, missing = row
        assert got[0].split()[:3] == label.split()[:3], label  # "shapley > broadcast"
        assert got[0].endswith(f"({family})"), label
        gone = set() if missing == "none" else {int(s) for s in missing.split(", ")}
        diffs = iter(per_seed.split(", "))  # the seeds with both cells, in order
        shown_diffs = ", ".join("—" if s in gone else next(diffs) for s in planned)
        assert _minus(got[1]) == shown_diffs, label
        assert _minus(got[2]) == f"{diff} {ci}", label
        assert got[3] == f"{p} ({holm})", label
        verdict = (
            "not yet" if held.startswith("not yet") else {"yes": "held", "no": "not held"}[held]
        )
        assert got[4] == verdict, label


FEEDBACK = EXPERIMENTS / "feedback-pool-v2" / "pool"
FEEDBACK_ROWS = ("the query alone", "the equal budget", "keyword expansion", "the start",
                 "shapley", "broadcast")  # fmt: skip


def _degenerate(record: dict) -> str:
    """'n of N': the record's greedy TEST rewrites that are a string of repeats."""
    from evaluator.text import degenerate

    rewrites = [r for query in record["rewrites"] for r in query]
    return f"{sum(map(degenerate, rewrites))} of {len(rewrites):,}"


def test_the_readme_feedback_table_is_the_cells_numbers() -> None:
    """feedback-pool-v2's README table: the baselines and the start (every start of the experiment
    agrees with the row at its precision), then per credit mode the mean pool recall with each
    seed's value, the mean served nDCG@10 and the degenerate rewrites of its cells together."""
    section, cells = _section("feedback-pool-v2"), _cells(FEEDBACK)
    header = re.search(r"pool recall, mean \(seeds? ([0-9, ]+)\)", section)
    assert header is not None, "the table's header names the planned seeds"
    seeds = [int(s) for s in header[1].split(",")]
    assert seeds == list(range(PLANNED["feedback-pool-v2"][1]))
    rows = {}
    for line in section.splitlines():
        if line.startswith("|") and _cols(line)[0] in FEEDBACK_ROWS:
            rows[_cols(line)[0]] = _cols(line)
    assert set(rows) == set(FEEDBACK_ROWS)
    starts = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(FEEDBACK.glob("start-*"))]
    assert starts, "the start's evaluation is committed"
    for record in [*starts, *cells.values()]:  # the baselines: the same queries in every file
        mean = {k: f"{statistics.fmean(record[k]):.4f}" for k in record if k != "rewrites"
                and isinstance(record[k], list) and isinstance(record[k][0], float)}  # fmt: skip
        assert rows["the query alone"][1:3] == [mean["query_pool_recall"], mean["query_ndcg@10"]]
        assert rows["the equal budget"][1:3] == [mean["budget_recall"], "—"]
        assert rows["keyword expansion"][1:3] == [mean["prf_recall"], mean["prf_served_ndcg@10"]]
    for start in starts:
        assert rows["the start"][1] == f"{statistics.fmean(start['pool_recall']):.4f}"
        assert rows["the start"][2] == f"{statistics.fmean(start['served_ndcg@10']):.4f}"
        assert rows["the start"][3] == _degenerate(start)
    for mode in ("shapley", "broadcast"):
        got = [cells.get((mode, s)) for s in seeds]
        done = [c for c in got if c is not None]
        per = ", ".join(
            "—" if c is None else f"{statistics.fmean(c['pool_recall']):.4f}" for c in got
        )
        if not done:
            assert rows[mode][1:4] == [f"— ({per})", "—", "—"], mode
            continue
        mean = statistics.fmean(statistics.fmean(c["pool_recall"]) for c in done)
        served = statistics.fmean(statistics.fmean(c["served_ndcg@10"]) for c in done)
        n = [int(x.replace(",", "")) for c in done for x in _degenerate(c).split(" of ")]
        assert rows[mode][1:4] == [
            f"{mean:.4f} ({per})",
            f"{served:.4f}",
            f"{sum(n[::2])} of {sum(n[1::2]):,}",
        ], mode
