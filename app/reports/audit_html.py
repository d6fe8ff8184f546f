"""The audit report a person reads in a browser: ONE self-contained HTML file (inline CSS and
inline SVG figures, no scripts, no external assets — it works offline and from ``file://``).

Read :func:`render_html`: verdict in plain words → setup → agreement by size (figure + table)
→ Δ scatter → φ agreement → the cost of cheap credit → how it is computed. Input is the
report JSON only (:mod:`app.reports.audit_json`), so a stored report re-renders identically.
"""

from __future__ import annotations

from html import escape
from typing import Any

from app.reports import audit_plots

CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; color: #212121;
       margin: 0; background: #fafafa; }
main { max-width: 980px; margin: 0 auto; padding: 24px 32px 64px; background: #fff; }
h1 { font-size: 26px; margin: 0 0 16px; } h2 { font-size: 19px; margin: 32px 0 8px; }
.verdict { border-left: 8px solid; padding: 12px 18px; border-radius: 4px; }
.verdict.agrees { border-color: #2e7d32; background: #e8f5e9; }
.verdict.partial { border-color: #ef6c00; background: #fff3e0; }
.verdict.disagrees { border-color: #c62828; background: #ffebee; }
.verdict .word { font-size: 20px; font-weight: 700; margin: 0; text-transform: uppercase; }
table { border-collapse: collapse; margin: 8px 0; font-size: 14px; }
th, td { border-bottom: 1px solid #e0e0e0; padding: 4px 10px; text-align: right; }
td { white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
td.pass { color: #2e7d32; font-weight: 600; } td.fail { color: #c62828; font-weight: 600; }
figure.plot { margin: 8px 0; } figure.plot svg { max-width: 100%; height: auto; }
p.note { color: #616161; font-size: 13px; }
"""

SETUP_FIELDS = (
    ("source", "rollouts"), ("policy_version", "policy version"), ("policy_name", "policy"),
    ("run_id", "training run"), ("split", "split"), ("n_queries_asked", "queries asked"),
    ("n_samples", "samples per query"), ("n_actions", "actions asked (m)"),
    ("anchor_query", "query as anchor player"), ("format_ok", "outputs with exactly m actions"),
    ("index_version", "index"), ("embedder_version", "embedder"), ("elapsed_s", "seconds"),
)  # fmt: skip


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return escape(str(x))


def _verdict(report: dict[str, Any]) -> str:
    v = report["verdict"]
    return (
        f'<section id="verdict" class="verdict {escape(v)}">'
        f'<p class="word">{escape(v)}</p><p>{escape(report["summary"])}</p>'
        f"<p>Recommended credit mode: <strong>{escape(report['recommended_credit'])}</strong></p>"
        "</section>"
    )


def _setup(report: dict[str, Any]) -> str:
    meta, cfg = report["meta"], report["config"]
    rows = [(label, meta[key]) for key, label in SETUP_FIELDS if key in meta]
    rows += [
        ("training evaluator", f"{report['train_evaluator']['name']} @ {report['train_evaluator']['version']}"),
        ("reference evaluator", f"{report['reference_evaluator']['name']} @ {report['reference_evaluator']['version']}"),
        ("rollouts / queries", f"{report['n_rollouts']} / {report['n_queries']}"),
        ("tie tolerance |Δ| ≤", f"{cfg['tol']:g}"), ("threshold", f"{cfg['threshold']:.2f}"),
        ("bootstrap", f"{cfg['n_boot']} resamples of queries, {cfg['level']:.0%} intervals"),
    ]  # fmt: skip
    body = "".join(f"<tr><td>{escape(k)}</td><td>{_fmt(v)}</td></tr>" for k, v in rows)
    return f'<section id="setup"><h2>Setup</h2><table>{body}</table></section>'


def _size_table(report: dict[str, Any]) -> str:
    head = (
        "<tr><th>size k</th><th>pairs</th><th>agreement</th><th>CI</th><th>decisive pairs"
        "</th><th>agreement (decisive)</th><th>ties: both</th><th>training only</th>"
        "<th>reference only</th><th>verdict</th></tr>"
    )
    rows = []
    for r in report["sizes"]:
        verdict = "no pairs" if not r["has_pairs"] else ("passes" if r["passed"] else "fails")
        css = "" if not r["has_pairs"] else ("pass" if r["passed"] else "fail")
        rows.append(
            f"<tr><td>{r['k']}</td><td>{r['n_pairs']}</td><td>{_fmt(r['agree'])}</td>"
            f"<td>[{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}]</td><td>{r['decisive_pairs']}</td>"
            f"<td>{_fmt(r['decisive_agree'])}</td><td>{_fmt(r['ties_both'])}</td>"
            f"<td>{_fmt(r['ties_train_only'])}</td><td>{_fmt(r['ties_reference_only'])}</td>"
            f'<td class="{css}">{verdict}</td></tr>'
        )
    return f'<table id="size-table">{head}{"".join(rows)}</table>'


def _sweep_table(report: dict[str, Any]) -> str:
    sizes = [r["k"] for r in report["sizes"]]
    head = (
        "<caption>agreement by size at other tie tolerances</caption><tr><th>tolerance</th>"
        + "".join(f"<th>size {k}</th>" for k in sizes)
        + "</tr>"
    )
    body = "".join(
        f"<tr><td>{row['tol']:g}</td>"
        + "".join(f"<td>{_fmt(a)}</td>" for a in row["agree"])
        + "</tr>"
        for row in report["tolerance_sweep"]
    )
    return f'<table id="sweep-table">{head}{body}</table>'


def _cheap_table(rows: list[dict[str, Any]], caption: str) -> str:
    head = (
        f"<caption>{escape(caption)}</caption><tr><th>m</th><th>rollouts</th>"
        "<th>singleton: ranking differs</th><th>pairs reversed</th><th>top differs</th>"
        "<th>leave-one-out: ranking differs</th><th>pairs reversed</th><th>top differs</th></tr>"
    )
    keys = ("rank_differs", "discordant_pairs", "top_differs")
    body = "".join(
        f"<tr><td>{r['m']}</td><td>{r['n_rollouts']}</td>"
        + "".join(
            f"<td>{_fmt(r[f'{b}_{k}'])}</td>" for b in ("singleton", "leave_one_out") for k in keys
        )
        + "</tr>"
        for r in rows
    )
    return f"<table>{head}{body}</table>"


def _figure(plot_id: str, svg: str, caption: str) -> str:
    return f'<figure class="plot" id="{plot_id}">{svg}<figcaption class="note">{escape(caption)}</figcaption></figure>'


METHOD = """<section id="method"><h2>How this is computed</h2><p>Both evaluators score the SAME
coalition lists (one retrieval, one list build per rollout). For every rollout, real action j and
coalition S of the other real actions, the marginal contribution v(S ∪ {j}) − v(S) is computed
under both; size k = |S| + 1. Signs are compared with a dead zone (|Δ| ≤ tolerance is a tie);
a tie in both counts as agreement and ties are shown apart. Intervals resample queries (a
query's rollouts and a rollout's marginals are not independent). A size passes when its
agreement reaches the threshold. Shapley φ mixes the marginals of every size, so it is
trusted only when every size passes; singleton credit reads only size-1 marginals and
leave-one-out only size-m ones (docs/methods.md §4; the statistic and the rule are CASI's).</p></section>"""


def render_html(report: dict[str, Any]) -> str:
    """The whole report as one HTML string."""
    train, ref = report["train_evaluator"]["name"], report["reference_evaluator"]["name"]
    title = f"CASI audit: {train} vs {ref}"
    sections = [
        f"<h1>{escape(title)}</h1>",
        _verdict(report),
        _setup(report),
        '<section id="by-size"><h2>Agreement by coalition size</h2>',
        _figure("plot-agreement", audit_plots.agreement_by_size(report),
                "Green: the size passes; red: it fails. Error bars: bootstrap interval."),
        _size_table(report), _sweep_table(report), "</section>",
        '<section id="scatter"><h2>Marginal contributions, training vs reference</h2>',
        _figure("plot-delta", audit_plots.delta_scatter(report),
                "Points in the shaded quadrants have the same sign under both evaluators."),
        "</section>",
        '<section id="phi"><h2>Shapley credit φ</h2>',
        _figure("plot-phi", audit_plots.phi_agreement(report),
                "Per action (left) and per rollout (Kendall τ_b, top action)."),
        "</section>",
        '<section id="cheap"><h2>The cost of cheap credit</h2>',
        _figure("plot-cheap", audit_plots.cheap_credit(report),
                "How often singleton / leave-one-out order a rollout's actions differently from Shapley."),
        _cheap_table(report["cheap_credit"]["reference"], f"{ref} (reference)"),
        _cheap_table(report["cheap_credit"]["train"], f"{train} (training)"),
        "</section>",
        METHOD,
    ]  # fmt: skip
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head>"
        f"<body><main>{''.join(sections)}</main></body></html>\n"
    )
