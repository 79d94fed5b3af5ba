"""What ``validate`` shows in the terminal, and its predicted-against-observed plot.

Every table fits an 80-column terminal: the means (predicted / observed), the errors of
the means and tails, the ranking check (``fitness.ranking``) and the summary. rich and
matplotlib are imported by the functions that draw.
"""

from __future__ import annotations

import re
from pathlib import Path

from evolve.report import fmt_cell, short_experiment_name
from fitness.headroom import COLUMNS as HEADROOM_COLUMNS
from fitness.headroom import KNOBS, factor_text
from fitness.headroom import title as headroom_title
from fitness.step_scatter import describe_scatter
from fitness.validate import ClosedLoopSettings

# ``validate``'s modes (evolve.validation): mode -> (what the command does, the table's title suffix)
VALIDATE_MODES: dict[str | None, tuple[str, str]] = {
    None: ("closed-loop runs", ""),
    "lomo": ("leave-one-model-out refits and closed-loop runs", "leave one model out"),
    "lowo": ("leave-one-workload-out refits and closed-loop runs", "leave one workload out"),
    "stage-transfer": (
        "low-rate-stage refit and closed-loop runs",
        "stage transfer: high-rate stages held out",
    ),
}
# (metric, stat) columns of the error table, and the latencies' display names and units
ERROR_COLUMNS = (
    ("e2e", "mean"),
    ("e2e", "p90"),
    ("e2e", "p99"),
    ("ttft", "mean"),
    ("ttft", "p90"),
    ("ttft", "p99"),
    ("itl", "mean"),
    ("itl", "p90"),
)
LABELS = {"e2e": "E2E", "ttft": "TTFT", "itl": "ITL", "tpot": "TPOT"}
MEAN_UNITS = (("e2e", "s", 1.0), ("ttft", "ms", 1e3), ("itl", "ms", 1e3))


def experiment_label(item: dict, with_rate: bool = True) -> str:
    """An item's experiment, short enough for one line of an 80-column table: no date prefix,
    no ``-hf`` or version suffix on the model (``mixtral-8x7b tp2 general``). A stage
    transfer's row also names its held-out stage by its rate, unless ``with_rate`` is off
    (the terminal's tables say the rate on a line above the rows: ``add_item_rows``)."""
    name = short_experiment_name(item["name"])
    if "held_out_stage" in item:  # stage transfer: one row per high-rate stage, named by its rate
        rate = item.get("rate_per_s")
        several = rate is None or item.get("held_out_stages", 1) > 1  # stages at one rate: say which
        label = stage_label(rate if with_rate else None, item["held_out_stage"] if several else None)
        name += f" {label}" if label else ""
    return name  # a held-out model or workload: every row is one, as the title says


def stage_label(rate_per_s: float | None, stage: int | None) -> str:
    """A load stage by its rate (``@20/s``) and, given ``stage``, its lifecycle file's name
    (``stage_1``: counted from 0, so "stage 1" alone would read as the first)."""
    rate = f"@{rate_per_s:g}/s" if rate_per_s is not None else ""
    return " ".join(part for part in (rate, f"stage_{stage}" if stage is not None else "") if part)


def add_item_rows(table, items: list[dict], cells) -> None:
    """A row per item: its label and ``cells(item)``. A stage transfer's rows go under a line
    per held-out rate (``@20/s``), in the items' order within it: with the rate in every
    label, the longest ones took two lines at 80 columns."""

    def rate(it: dict) -> float | None:
        return it.get("rate_per_s") if "held_out_stage" in it else None

    for held_out in sorted({rate(it) for it in items} - {None}):
        table.add_row(f"[bold]{stage_label(held_out, None)}[/]")
        for it in items:
            if rate(it) == held_out:
                table.add_row("  " + experiment_label(it, with_rate=False), *cells(it))
    for it in items:  # every row of any other check, and a stage of no known rate: as they are
        if rate(it) is None:
            table.add_row(experiment_label(it), *cells(it))


def fmt_error(value: float | None) -> str:
    """A signed relative error in percent, coloured (green within 10%, yellow within 15%);
    without a % sign: the error table's title says "in %"."""
    if value is None:
        return "—"
    colour = "green" if abs(value) <= 0.10 else ("yellow" if abs(value) <= 0.15 else "red")
    pct = 100.0 * value
    text = f"{pct:+.1f}" if abs(pct) < 100 else (f"{pct:+.0f}" if pct < 1000 else ">999")
    return f"[{colour}]{text}[/]"


def fmt_share(fraction) -> str:
    """A fraction as a percentage: one decimal below 1000%, none above ('—' when not a number)."""
    if not isinstance(fraction, (int, float)):
        return "—"
    return f"{100 * fraction:.1f}%" if abs(fraction) < 10 else f"{100 * fraction:.0f}%"


def fmt_value(value: float | None, scale: float = 1.0) -> str:
    """Three significant figures or so, without exponents ('—' when missing)."""
    if value is None:
        return "—"
    x = value * scale
    if x == 0:
        return "0"
    # by the rounded value: 9.996 shows as 10.0, not 10.00 beside a 10.2
    return f"{x:.0f}" if abs(x) >= 99.95 else (f"{x:.1f}" if abs(x) >= 9.995 else f"{x:.2f}")


def _table(title: str):
    from rich import box
    from rich.table import Table

    return Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), pad_edge=False, title_justify="left")


def means_table(result: dict, title: str):
    """Per experiment: mean E2E, TTFT, ITL and the failed share, predicted / observed."""
    t = _table(title)
    t.add_column("experiment", overflow="fold", ratio=1)
    for m, unit, _ in MEAN_UNITS:
        t.add_column(f"{LABELS[m]} {unit}", justify="right", no_wrap=True)
    t.add_column("failed %", justify="right", no_wrap=True)
    add_item_rows(t, result.get("experiments", []), _mean_cells)
    return t


def _mean_text(value_s: float | None, scale: float) -> str:
    """A mean in the column's unit; a time the column gives in ms but that took 10 s or more
    (an overloaded run's TTFT) in seconds, with its unit: 100 s, not 100030."""
    if scale != 1.0 and value_s is not None and value_s >= 10.0:
        return f"{fmt_value(value_s)} s"
    return fmt_value(value_s, scale)


def _mean_cells(it: dict) -> list[str]:
    """An item's means and failed share, predicted / observed."""
    cells = [" / ".join(_mean_text(it.get(f"{m}_mean{w}_s"), k) for w in ("_pred", "_obs")) for m, _, k in MEAN_UNITS]
    fail = [it.get("failure_fraction_pred"), it.get("failure_fraction_obs")]
    if fail == [None, None] and "failures_pred" in it:  # items from before failure fractions
        fail = [it.get("failures_pred"), it.get("failures_obs")]
        return [*cells, " / ".join("—" if f is None else str(f) for f in fail)]
    return [*cells, " / ".join(fmt_value(f, 100.0) for f in fail)]


def errors_table(result: dict, title: str):
    """Per experiment with results: the signed errors of the means and tails of E2E, TTFT and
    ITL (None if no experiment has any; rows of dashes only would say nothing)."""
    observed = [
        it for it in result.get("experiments", []) if any(_error(it, m, s) is not None for m, s in ERROR_COLUMNS)
    ]
    if not observed:
        return None
    t = _table(title)
    t.add_column("experiment", overflow="fold", ratio=1)
    for m, stat in ERROR_COLUMNS:
        t.add_column(f"{LABELS[m]}\n{stat}", justify="right", no_wrap=True)
    add_item_rows(t, observed, lambda it: [fmt_error(_error(it, m, s)) for m, s in ERROR_COLUMNS])
    return t


def _error(item: dict, metric: str, stat: str) -> float | None:
    """An error of an item; the mean's also under its first name (``e2e_error``), as older results have it."""
    if f"{metric}_{stat}_error" in item:
        return item[f"{metric}_{stat}_error"]
    return item.get(f"{metric}_error") if stat == "mean" else None


def ranking_table(ranking: list[dict]):
    """Wrongly ordered pairs of experiments (of those apart by more than the threshold), and Kendall's tau."""
    t = _table("Ranking: pairs apart by > 10%, and how many are ordered wrongly")
    for col in ("statistic", "pairs", "model wrong", "baseline wrong", "tau model", "tau baseline"):
        t.add_column(col, justify="left" if col == "statistic" else "right")
    for r in ranking:
        metric, stat = r["stat"].split("_")
        t.add_row(
            f"{LABELS.get(metric, metric)} {stat}",
            str(r["pairs"]),
            str(r["inversions"]),
            baseline_wrong(r),
            fmt_value(r.get("kendall_tau")),
            fmt_value(r.get("baseline_kendall_tau")),
        )
    return t


def baseline_wrong(row: dict) -> str:
    """The baseline's wrongly ordered pairs, and out of how many where that is not the model's count."""
    wrong = str(row.get("baseline_inversions", "—"))
    return wrong + (f" of {row['baseline_pairs']}" if row.get("baseline_pairs", row["pairs"]) != row["pairs"] else "")


def unfitted_note(result: dict) -> str:
    """A line on the models the baseline could not be fitted for ("" where there are none)."""
    models = (result.get("baseline") or {}).get("unfitted") or []
    return f"no baseline for {', '.join(models)}: every request of its runs failed" if models else ""


ITL_P50_NOTE = "ITL p50 is the gap between a token's two events (tens of µs), not a step"
_SUMMARY_KEY = re.compile(r"^(e2e|ttft|itl|tpot)(?:_(mean|p\d+(?:\.\d+)?))?_error_(mean|max)$")


def summary_table(summary: dict, title: str = "Summary: |error| of the experiments"):
    """The summary's error statistics as rows (metric and statistic) by columns (mean, max); the rest below."""
    t = _table(title)
    t.add_column("latency")
    t.add_column("mean |error|", justify="right")
    t.add_column("max |error|", justify="right")
    rows: dict[str, dict[str, float]] = {}
    other = []
    for key, value in summary.items():
        if isinstance(value, dict):
            continue
        m = _SUMMARY_KEY.match(key)
        if m:
            rows.setdefault(f"{LABELS[m.group(1)]} {m.group(2) or 'mean'}", {})[m.group(3)] = value
        elif key.startswith("failure_fraction_diff_pp_"):
            rows.setdefault("failed (pp)", {})[key.rsplit("_", 1)[1]] = value
        else:
            other.append(f"{key.replace('_', ' ')} {fmt_cell(key, value)}")
    order = [f"{LABELS[m]} {stat}" for m in LABELS for stat in ("mean", "p50", "p90", "p99")]
    for label, v in sorted(rows.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
        fmt = fmt_value if label == "failed (pp)" else fmt_share
        t.add_row(label, fmt(v.get("mean")), fmt(v.get("max")))
    notes = [", ".join(other)] if other else []
    if "ITL p50" in rows:  # its large errors are of microseconds, not of a step
        notes.append(ITL_P50_NOTE)
    if not notes:
        return t
    from rich.console import Group  # the lines below it, wrapped at the terminal's width, not the table's

    return Group(t, *notes)


def headroom_table(headroom: dict):
    """Per experiment: the failed share as modelled, and the factors on step time and on load
    at which more than the threshold fail (``fitness.headroom``)."""
    t = _table(headroom_title(headroom["failed_threshold"]))
    for col in HEADROOM_COLUMNS:
        t.add_column(col, justify="left" if col == "experiment" else "right")
    for item in headroom["experiments"]:
        failed = fmt_share(item["failure_fraction_pred"])
        t.add_row(experiment_label(item), failed, *(factor_text(item[knob]) for knob in KNOBS))
    return t


def scatter_note(result: dict) -> str:
    """One line on the measured step scatter the simulation used ("" without one)."""
    return describe_scatter(result["step_scatter"]) if result.get("step_scatter") else ""


def print_validation(console, result: dict, title: str) -> None:
    """Every table of a validation (the per-held-out-group summaries too) and the plot's path,
    under TITLE as a line of its own (in a table's title it wrapped at 80 columns)."""
    console.print(title, style="bold", markup=False, highlight=False)
    console.print(means_table(result, "Means: predicted / observed"))
    errors = errors_table(result, "Signed errors in % (pred / obs - 1)")
    if errors is not None:
        console.print(errors)
    if any(it.get(f"{m}_mean_obs_s") is None for it in result.get("experiments", []) for m, _, _ in MEAN_UNITS):
        console.print("—: nothing to compare (results withheld or absent, or every request failed)")
    if result.get("ranking"):
        console.print(ranking_table(result["ranking"]))
    if unfitted := unfitted_note(result):
        console.print(unfitted, markup=False, highlight=False)
    console.print(summary_table(result.get("summary", {})))
    if result.get("headroom"):
        console.print(headroom_table(result["headroom"]))
        console.print("x1.30: 30% slower steps (or 30% more load) tip it; below x1: it fails already")
    first = result.get("load_seed", 0)
    if result.get("load_draws", 1) > 1:
        n = result["load_draws"]
        seeds = ClosedLoopSettings(first, n).seed_range
        console.print(f"predicted: the mean of {n} draws of the load, seeds {seeds} (their range: --json, --report)")
        inside = result.get("summary", {}).get("obs_in_range", {})
        counts = [
            f"{LABELS[m]} {inside[f'{m}_mean'][0]}/{inside[f'{m}_mean'][1]}" for m in LABELS if f"{m}_mean" in inside
        ]
        if counts:  # where it lies outside, the miss is the model's, not the load's randomness
            console.print("means inside the draws' range: " + ", ".join(counts))
    elif first:
        console.print(f"predicted: draw {first} of the load (--seed)")
    note = scatter_note(result)
    if note:
        console.print(note, markup=False, highlight=False)
    for item in result.get("experiments", []):
        if item.get("no_success"):
            console.print(f"{item['name']}: no request succeeded: {item['no_success']}", markup=False, soft_wrap=True)
    for key, groups in result.get("summary", {}).items():  # per held-out model or workload: a summary each
        if isinstance(groups, dict) and groups and all(isinstance(g, dict) for g in groups.values()):
            console.print(held_out_table(groups, key[:-1]))
    if result.get("plot"):
        console.print(f"plot: {result['plot']}", markup=False, highlight=False, soft_wrap=True)


def predicted_vs_observed_figure(items: list[dict], title: str, stats: tuple[str, ...] = ("mean",)):
    """One panel per statistic (rows) and latency (E2E, TTFT, ITL): predicted against observed, ±10% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from fitness.replay_rows import REPLAY_METRICS

    rows = [i for i in items if i.get("e2e_mean_obs_s") is not None]
    if not rows:
        return None
    fig, axes = plt.subplots(len(stats), 3, figsize=(13, 4.2 * len(stats)), squeeze=False)
    models = sorted({i["model"] for i in rows})
    colours = dict(zip(models, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for stat, axrow in zip(stats, axes, strict=True):
        for ax, m in zip(axrow, REPLAY_METRICS, strict=True):
            have = [i for i in rows if i.get(f"{m}_{stat}_obs_s") and i.get(f"{m}_{stat}_pred_s")]
            if not have:
                ax.set_axis_off()
                continue
            obs = np.array([i[f"{m}_{stat}_obs_s"] for i in have])
            pred = np.array([i[f"{m}_{stat}_pred_s"] for i in have])
            lo, hi = min(obs.min(), pred.min()) * 0.8, max(obs.max(), pred.max()) * 1.25
            xs = np.geomspace(lo, hi, 50)
            ax.fill_between(xs, xs * 0.9, xs * 1.1, color="0.9", label="±10%")
            ax.plot(xs, xs, color="0.5", lw=1)
            for model in models:
                sel = [k for k, i in enumerate(have) if i["model"] == model]
                ax.scatter(obs[sel], pred[sel], s=28, color=colours[model], label=model)
                spread = [(have[k].get(f"{m}_{stat}_pred_min_s"), have[k].get(f"{m}_{stat}_pred_max_s")) for k in sel]
                if sel and all(a is not None and b is not None for a, b in spread):  # range over the draws of the load
                    below = pred[sel] - np.array([a for a, _ in spread])
                    above = np.array([b for _, b in spread]) - pred[sel]
                    ax.errorbar(obs[sel], pred[sel], yerr=[below, above], fmt="none", ecolor=colours[model], lw=1)
            ax.set_xscale("log")
            ax.set_yscale("log")
            # labels at 1, 2 and 5 of each decade, so short ranges get some too; at 1 only over
            # more than three decades (an overloaded run beside the others), where they would overlap
            subs = (1.0, 2.0, 5.0) if np.log10(hi / lo) <= 3 else (1.0,)
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_locator(LogLocator(subs=subs))
                axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                axis.set_minor_formatter(NullFormatter())
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
            ax.set_xlabel(f"observed {stat} {m.upper()} (s)")
            ax.set_ylabel(f"predicted {stat} {m.upper()} (s)")
            ax.set_title(f"{m.upper()} {stat}")
    if axes[0][0].get_legend_handles_labels()[0]:  # no panel when no experiment had a successful request
        axes[0][0].legend(fontsize=7, loc="upper left")
    draws = max((len(i.get("load_seeds", ())) for i in rows), default=0)
    fig.suptitle(title + (f" (mean of {draws} draws of the load; bars: their range)" if draws > 1 else ""), fontsize=10)
    fig.tight_layout()
    return fig


def plot_predicted_vs_observed(items: list[dict], path: Path, title: str) -> Path | None:
    """The means' predicted-against-observed figure, saved as PNG at PATH (None without results)."""
    fig = predicted_vs_observed_figure(items, title)
    if fig is None:
        return None
    from io import BytesIO

    import matplotlib.pyplot as plt

    from primitives.files import atomic_write_bytes

    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_bytes(path, buf.getvalue())


HELD_OUT_COLUMNS = {  # the mean latencies' errors: every statistic is in the JSON, this fits 80 columns
    "e2e_error_mean": "E2E",
    "e2e_error_max": "E2E max",
    "ttft_error_mean": "TTFT",
    "ttft_error_max": "TTFT max",
    "itl_error_mean": "ITL",
    "itl_error_max": "ITL max",
}


def held_out_table(groups: dict, what: str):
    """Per held-out model or workload: mean and worst |error| of the mean E2E, TTFT and ITL."""
    from rich.console import Group
    from rich.text import Text

    t = _table(None)
    t.add_column(what, overflow="fold", ratio=1)
    for label in HELD_OUT_COLUMNS.values():
        t.add_column(label, justify="right", no_wrap=True)
    notes = []
    for g, v in groups.items():
        t.add_row(g, *(fmt_share(v.get(k)) for k in HELD_OUT_COLUMNS))
        if v.get("all_failed"):  # runs with no latency to compare: a row of dashes, or errors of the others
            pp = v.get("failure_fraction_diff_pp_max")
            off = f"; its failed share predicted within {pp:.1f} pp" if pp is not None else ""
            if all(v.get(k) is None for k in HELD_OUT_COLUMNS):
                what_failed = "every request of its real runs failed, no latency to compare"
            else:
                runs = f"{v['all_failed']} of its {v.get('with_results', '?')} real runs"
                what_failed = f"{runs} failed every request, not in its errors"
            notes.append(Text(f"{g}: {what_failed}{off}"))
    return Group(f"\nper held-out {what}: |error| of the means (all statistics: --json)", t, *notes)
