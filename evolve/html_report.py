"""``validate ID --experiments DIR --report DIR``: one self-contained HTML page.

The page holds everything a validation found, images embedded as base64 PNG (no file
beside it is needed): the errors of the means and tails per experiment and per load
stage, predicted against observed for the mean, p90 and p99 of E2E, TTFT and ITL, each
experiment's percentile curves (observed p0.1 ... p99.9 from the lifecycle files against
the simulated ones, for E2E and TTFT, whole run and per stage), the ranking check against
the BLIS blackbox baseline, the headroom before requests time out (with ``--headroom``:
``fitness.headroom``), and the model: expression, fitted efficiencies
(``fitness.physics_check.term_efficiencies``), overheads and data fingerprint.
"""

from __future__ import annotations

import base64
import io
from datetime import datetime, timezone
from html import escape
from pathlib import Path

from evolve.validation_view import (
    LABELS,
    baseline_wrong,
    experiment_label,
    fmt_share,
    predicted_vs_observed_figure,
    scatter_note,
    stage_label,
    unfitted_note,
)
from fitness.headroom import COLUMNS as HEADROOM_COLUMNS
from fitness.headroom import KNOBS, factor_text
from fitness.headroom import title as headroom_title
from fitness.validate import ClosedLoopSettings, every_request_failed
from primitives.distribution import PERCENTILES, stat_key
from primitives.files import atomic_write_text

# (metric, stat) columns of the page's error tables
ERROR_COLUMNS = [(m, s) for m in ("e2e", "ttft", "itl") for s in ("mean", "p50", "p90", "p99")] + [("tpot", "mean")]
# shown, not judged: half the gaps pooled into ITL are the tens of µs between a token's two
# streamed events (the client's own, event_gap_us in the simulator), so its median is that gap
UNJUDGED = {("itl", "p50")}
CURVE_METRICS = ("e2e", "ttft")
STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1250px; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ccc; margin-top: 1.8em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.85em; }
th, td { border: 1px solid #ddd; padding: 0.2em 0.5em; text-align: right; }
th { background: #f3f3f3; } td.name, th.name { text-align: left; }
td.good { background: #e4f5e4; } td.fair { background: #fdf3d0; } td.bad { background: #f9dcdc; }
td.info { color: #777; }
code, pre { background: #f6f6f6; padding: 0.1em 0.3em; } pre { white-space: pre-wrap; word-break: break-all; }
img { max-width: 100%; } .note { color: #555; font-size: 0.9em; }
"""


def png_base64(fig) -> str:
    """A matplotlib figure as base64 PNG (the figure is closed)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _img(fig, alt: str) -> str:
    if fig is None:
        return f"<p class='note'>({escape(alt)}: no experiment with results)</p>"
    return f"<img alt='{escape(alt)}' src='data:image/png;base64,{png_base64(fig)}'>"


def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    """An HTML table; the first column is a name. Cells are HTML already (escape text first)."""
    head = "".join(f"<th{' class=name' if i == 0 else ''}>{h}</th>" for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(rows_cell(i, c) for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table class='{cls}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def rows_cell(i: int, cell: str) -> str:
    return cell if cell.startswith("<td") else f"<td{' class=name' if i == 0 else ''}>{cell}</td>"


def _num(v, scale: float = 1.0, digits: int = 4) -> str:
    return "—" if v is None else f"{v * scale:.{digits}g}"


def _grade(miss: float, good: float, fair: float) -> str:
    """The cell's colour class: within GOOD green, within FAIR yellow, red beyond."""
    return "good" if miss <= good else ("fair" if miss <= fair else "bad")


def _error_cell(item: dict, metric: str, stat: str) -> str:
    err = item.get(f"{metric}_{stat}_error")
    if err is None:
        return "<td>—</td>"
    if (metric, stat) in UNJUDGED:
        cls = "info"
    else:
        cls = _grade(abs(err), 0.10, 0.15)
    pred, obs = item.get(f"{metric}_{stat}_pred_s"), item.get(f"{metric}_{stat}_obs_s")
    tip = f"predicted {_num(pred)} s, observed {_num(obs)} s"
    low, high = item.get(f"{metric}_{stat}_pred_min_s"), item.get(f"{metric}_{stat}_pred_max_s")
    if low is not None and high is not None:
        tip += f" (simulated {_num(low)} to {_num(high)} s over the draws of the load"
        inside = item.get(f"{metric}_{stat}_obs_in_range")
        tip += (
            ")" if inside is None else (": the observation is inside)" if inside else ": the observation is outside)")
        )
    return f"<td class='{cls}' title='{escape(tip)}'>{_pct(err, signed=True)}</td>"


def _pct(fraction, signed: bool = False) -> str:
    """A fraction as a percentage: one decimal below 100%, none above."""
    if fraction is None:
        return "—"
    v = 100.0 * fraction
    return f"{v:{'+' if signed else ''}.{1 if abs(v) < 100 else 0}f}%"


def _fail(item: dict) -> str:
    """Failed share, predicted / observed, to one decimal as the terminal's table gives it;
    coloured by their difference in percentage points where both are known (goal: 10)."""
    pred, obs = item.get("failure_fraction_pred"), item.get("failure_fraction_obs")
    text = f"{fmt_share(pred)} / {fmt_share(obs)}"
    if pred is None or obs is None:
        return text
    pp = round(100.0 * abs(pred - obs), 1)  # as shown: 0.0% / 10.0% is within 10
    return f"<td class='{_grade(pp, 10, 15)}' title='{pp:.1f} percentage points apart'>{text}</td>"


def error_rows(items: list[dict], stages: bool) -> list[list[str]]:
    """One row per experiment (and per load stage under it when STAGES): errors and failed %."""
    rows = []
    for it in items:
        rows.append([escape(experiment_label(it))] + [_error_cell(it, m, s) for m, s in ERROR_COLUMNS] + [_fail(it)])
        for st in it.get("stages", []) if stages and len(it.get("stages", [])) > 1 else []:
            label = f"&nbsp;&nbsp;{stage_label(st['rate_per_s'], st['stage'])}"
            rows.append([label] + [_error_cell(st, m, s) for m, s in ERROR_COLUMNS] + [_fail(st)])
    return rows


def _error_header() -> list[str]:
    return ["experiment"] + [f"{LABELS[m]} {s}" for m, s in ERROR_COLUMNS] + ["failed pred / obs"]


def summary_rows(summary: dict) -> list[list[str]]:
    """Mean and max absolute error of each (latency, statistic) over the experiments with results;
    with several draws of the load, how many observations lie inside the draws' range too."""
    rows = []
    inside = summary.get("obs_in_range")
    for m, s in ERROR_COLUMNS:
        key = f"{m}_error" if s == "mean" else f"{m}_{s}_error"
        if f"{key}_mean" in summary:
            row = [f"{LABELS[m]} {s}", _pct(summary[f"{key}_mean"]), _pct(summary[f"{key}_max"])]
            if inside:
                got = inside.get(f"{m}_{s}")
                row.append(f"{got[0]} of {got[1]}" if got else "—")
            rows.append(row)
    if summary.get("failure_fraction_diff_pp_mean") is not None:
        pp = [f"{summary[f'failure_fraction_diff_pp_{k}']:.1f} pp" for k in ("mean", "max")]
        rows.append(["failed fraction", *pp] + (["—"] if inside else []))
    return rows


def summary_header(summary: dict) -> list[str]:
    return ["latency", "mean |error|", "max |error|"] + (
        ["observed inside the range of the draws"] if summary.get("obs_in_range") else []
    )


# -- percentile curves ------------------------------------------------------------------
def _tail_axis(ax) -> None:
    """x: the percentile on a tail-stretching scale, -log10(1 - p/100) (p90 at 1, p99 at 2)."""
    import numpy as np

    ticks = [0.1, 50, 90, 99, 99.9]
    ax.set_xticks([-np.log10(1 - p / 100) for p in ticks])
    ax.set_xticklabels([f"p{p:g}" for p in ticks])
    ax.set_xlabel("percentile")


def curves_figure(item: dict):
    """Observed (solid) against simulated (dashed) percentile curves of E2E and TTFT, whole run and per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    xs = np.array([-np.log10(1 - p / 100) for p in PERCENTILES])
    keys = [stat_key(p) for p in PERCENTILES]
    fig, axes = plt.subplots(1, len(CURVE_METRICS), figsize=(12, 3.6))
    stages = item.get("stages", []) if len(item.get("stages", [])) > 1 else []
    scopes = [("whole run", item, "black")] + [
        (stage_label(st["rate_per_s"], st["stage"]), st, colour)
        for st, colour in zip(stages, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"], strict=False)
    ]
    for ax, m in zip(axes, CURVE_METRICS, strict=True):
        low, high = np.inf, 0.0
        for label, scope, colour in scopes:
            curves = scope.get("percentiles_s", {}).get(m, {})
            for kind, style in (("obs", "-"), ("pred", "--")):
                curve = curves.get(kind) or {}
                if all(k in curve for k in keys):
                    ys = np.array([curve[k] for k in keys])
                    low, high = min(low, ys.min()), max(high, ys.max())
                    name = f"{label}, {'observed' if kind == 'obs' else 'simulated'}"
                    ax.plot(xs, ys, style, color=colour, marker="o" if kind == "obs" else None, ms=3, label=name)
        if 0 < low and high > 10 * low:  # a log scale where the curves span decades
            ax.set_yscale("log")
        _tail_axis(ax)
        ax.set_ylabel(f"{LABELS[m]} (s)")
        ax.set_title(LABELS[m])
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if not labels:  # no curve at all: every request timed out, and no results to compare
        axes[0].text(0.5, 0.5, "no successful request", transform=axes[0].transAxes, ha="center")
    else:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.06 * ((len(labels) + 3) // 4), 1, 1))
    return fig


# -- the page ------------------------------------------------------------------------
def _ranking_section(result: dict) -> str:
    ranking = result.get("ranking") or []
    if not ranking:
        return "<p class='note'>no ranking check (needs experiments with results)</p>"
    has_base = any("baseline_inversions" in r for r in ranking)
    header = ["statistic", "experiments", "pairs apart by &gt; 10%", "model: ordered wrongly", "model: Kendall tau"]
    header += ["baseline: ordered wrongly", "baseline: Kendall tau"] if has_base else []
    rows, details = [], []
    for r in ranking:
        m, s = r["stat"].split("_")
        row = [
            f"{LABELS[m]} {s}",
            str(r["experiments"]),
            str(r["pairs"]),
            str(r["inversions"]),
            _num(r["kendall_tau"], 1, 3),
        ]
        if has_base:
            row += [baseline_wrong(r), _num(r.get("baseline_kendall_tau"), 1, 3)]
        rows.append(row)
        for who, key in (("model", "inverted_pairs"), ("baseline", "baseline_inverted_pairs")):
            pairs = "; ".join(" vs ".join(escape(experiment_label({"name": n})) for n in p) for p in r.get(key, []))
            if pairs:
                details.append(f"<li>{LABELS[m]} {s}, {who} orders wrongly: {pairs}</li>")
    note = (
        "<p class='note'>A pair counts when the observed values differ by more than 10% (larger over smaller); "
        "it is ordered wrongly when the predictions do not differ in the same direction (ties count as wrong). "
        "Kendall's tau (tau-b) is over every experiment with results, close pairs included.</p>"
    )
    return _table(header, rows) + note + (f"<ul>{''.join(details)}</ul>" if details else "")


def _headroom_section(result: dict) -> str:
    """The factors on step time and on load at which more than the threshold of requests fail."""
    headroom = result.get("headroom")
    if not headroom:
        return "<p class='note'>not measured: <code>validate --headroom</code> adds it.</p>"
    rows = [
        [escape(experiment_label(i)), _pct(i["failure_fraction_pred"])]
        + [escape(factor_text(i[knob])) for knob in KNOBS]
        for i in headroom["experiments"]
    ]
    note = (
        f"<p class='note'>{escape(headroom_title(headroom['failed_threshold']))}: every step that factor slower, "
        "or every stage's rate that factor higher. Below x1 an experiment fails already: the factor at which it "
        "would stop. Near saturation a few percent decide it.</p>"
    )
    return note + _table(list(HEADROOM_COLUMNS), rows)


def _baseline_section(result: dict) -> str:
    base = result.get("baseline")
    if not base:
        return "<p class='note'>no baseline in this validation (run with --baseline or --report)</p>"
    fits = [
        [escape(model), f"<code>{escape(v['expression'])}</code>", escape(_overheads(v["overheads"]))]
        for model, v in base["models"].items()
    ]
    return (
        f"<p>{escape(base['method'])}.</p>"
        + _table(["model", "fitted step time (µs)", "fitted overheads (µs)"], fits)
        + _note(unfitted_note(result))
        + "<h3>Baseline errors (closed loop)</h3>"
        + _table(_error_header(), error_rows(base["experiments"], stages=False))
        + _table(summary_header(base.get("summary", {})), summary_rows(base.get("summary", {})))
    )


def _overheads(overheads: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in overheads.items() if v) or "none"


def _model_section(entry, run_dir: Path | None = None, resolver=None) -> str:
    from fitness.efficiency import run_efficiency_bounds
    from fitness.physics_check import bound_flag, term_efficiencies

    bounds = run_efficiency_bounds(entry.run_config)
    eff = [
        [
            f"<code>{escape(r['term'])}</code>",
            f"{r['coefficient']:.5g}",
            escape(r["kind"]),
            escape(bound_flag(r)),
        ]
        for r in term_efficiencies(entry.expression, bounds)
    ]
    facts = [
        ["id", escape(entry.id)],
        ["complexity", str(entry.complexity)],
        ["run", escape(entry.run_id or "—")],
        ["data fingerprint", f"<code>{escape(entry.dataset_fingerprint or '—')}</code>"],
        ["non-step terms (µs)", escape(_overheads(entry.overheads))],
    ]
    return (
        f"<p>Step time (µs):</p><pre>{escape(entry.expression)}</pre>"
        + _table(["", "value"], facts)
        + f"<h3>Fitted efficiencies (µs terms bounded to {escape(bounds.describe('–'))})</h3>"
        + (_table(["term", "coefficient", "kind", "flag"], eff) if eff else "<p>a constant: no terms</p>")
        + _floor_section(entry, run_dir, resolver)
    )


def _floor_section(entry, run_dir: Path | None = None, resolver=None) -> str:
    """The kernel floor on every catalog deployment (``evolve.kernel_floor_view``); nothing
    where the run's data cannot be found."""
    from evolve.kernel_floor_view import FLOOR_CAPTION, FLOOR_TITLE, catalog_floor, floor_rows
    from primitives.deployment import CATALOG_TPS, default_resolver

    ratios = catalog_floor(entry, run_dir, resolver or default_resolver())
    if not ratios:
        return ""
    rows = [[escape(cell) for cell in row] for row in floor_rows(ratios)]
    return (
        f"<h3>{escape(FLOOR_TITLE)} ({escape(ratios[0][0].gpu.name)})</h3>"
        + _table(["model", *(f"TP{tp}" for tp in CATALOG_TPS)], rows)
        + "<p class='note'>The Go export for BLIS (<code>--blis</code>) ships the model for every deployment "
        + f"of this table. {escape(FLOOR_CAPTION[:1].upper() + FLOOR_CAPTION[1:])}.</p>"
    )


def _note(text: str) -> str:
    """TEXT as a note paragraph of its own ("" stays "")."""
    return f"<p class='note'>{escape(text)}.</p>" if text else ""


def _sentence(text: str) -> str:
    """TEXT as a sentence of the header ("" stays "")."""
    return f" {escape(text[:1].upper() + text[1:])}." if text else ""


def _draws_note(result: dict) -> str:
    scale = result.get("step_time_scale", 1.0)
    what_if = f" What-if: every step takes {scale:g} times the model's step time." if scale != 1.0 else ""
    first, n = result.get("load_seed", 0), result.get("load_draws", 1)  # as the terminal says it
    if n <= 1:  # draw 0 is the default: said only when another was asked for
        return what_if + (f" The load is the generator's draw {first} (validate --seed {first})." if first else "")
    return what_if + (
        f" Each simulated figure is the mean of {n} draws of the load (arrival times and prompt"
        f" lengths; seeds {ClosedLoopSettings(first, n).seed_range});"
        " the bars of the predicted-against-observed plots and a cell's hover text give their range."
    )


def _unscored(item: dict) -> str:
    if every_request_failed(item):
        return "every request of the real run failed"
    return "results withheld" if item.get("failures_obs") is None else "the real run's results count no request"


def render(result: dict, entry, experiments_dir: str = "", run_dir: Path | None = None, resolver=None) -> str:
    """The whole page (a string of HTML)."""
    items = result.get("experiments", [])
    scored = [i for i in items if i.get("e2e_mean_obs_s") is not None]
    summary = result.get("summary", {})
    with_results, all_failed = summary.get("with_results", len(scored)), summary.get("all_failed", 0)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fig = predicted_vs_observed_figure(items, f"{entry.id}: predicted against observed", ("mean", "p90", "p99"))
    curves = "".join(
        f"<h3>{escape(experiment_label(it))}</h3>"
        + ("" if it in scored else f"<p class='note'>{_unscored(it)}: simulated curves only</p>")
        + _img(curves_figure(it), f"percentile curves of {it['name']}")
        for it in items
    )
    sections = [
        f"<h1>Validation of {escape(entry.id)}</h1>",
        f"<p class='note'>closed loop over {len(items)} experiments ({with_results} with results"
        + (f"; in {all_failed} every request failed, so only the failed share is compared" if all_failed else "")
        + ") under "
        f"<code>{escape(experiments_dir)}</code>; written {when}. Errors are predicted / observed − 1, "
        "over the successful requests; ITL pools every gap between streamed events (two events per token)."
        + _draws_note(result)
        + _sentence(scatter_note(result))
        + "</p>",
        "<h2>Summary</h2>",
        _table(summary_header(summary), summary_rows(summary)),
        "<h2>Errors per experiment and load stage</h2>",
        "<p class='note'>green within 10%, yellow within 15%, red beyond (the failed share: within 10 and 15"
        " percentage points); hover a cell for the values. "
        "ITL p50 is uncoloured: half of ITL's pooled gaps are the tens of microseconds between a token's "
        "two streamed events, so its median is that client-side gap, not a step.</p>",
        _table(_error_header(), error_rows(items, stages=True)),
        "<h2>Predicted against observed: mean, p90, p99</h2>",
        _img(fig, "predicted against observed"),
        "<h2>Ranking check</h2>",
        _ranking_section(result),
        "<h2>Headroom before requests time out</h2>",
        _headroom_section(result),
        "<h2>Percentile curves (observed solid, simulated dashed)</h2>",
        curves,
        "<h2>The model</h2>",
        _model_section(entry, run_dir, resolver),
        "<h2>Baseline: BLIS blackbox</h2>",
        _baseline_section(result),
    ]
    body = "\n".join(sections)
    title = f"Validation of {escape(entry.id)}"
    head = f"<meta charset='utf-8'><title>{title}</title><style>{STYLE}</style>"
    return f"<!DOCTYPE html>\n<html lang='en'><head>{head}</head><body>\n{body}\n</body></html>\n"


def write_report(
    result: dict, entry, report_dir: Path, experiments_dir: str = "", run_dir: Path | None = None, resolver=None
) -> Path:
    """Write ``validate-<id>.html`` into REPORT_DIR; returns its path."""
    Path(report_dir).mkdir(parents=True, exist_ok=True)
    path = Path(report_dir) / f"validate-{entry.id}.html"
    atomic_write_text(path, render(result, entry, experiments_dir, run_dir, resolver))
    return path
