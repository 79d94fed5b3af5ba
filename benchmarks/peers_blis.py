"""BLIS as a peer: BLIS's own backends and the exported model run in BLIS, against the
project's closed-loop simulation of the same model, on every experiment with results.

For each experiment under ``--experiments DIR`` that has ``results/``, its
``results/config.yaml`` (stages, shared-prefix shape) becomes a BLIS workload spec
(``inference_perf``: ``num_groups`` -> ``num_unique_system_prompts``,
``num_prompts_per_group`` -> ``num_users_per_system_prompt``, the lengths as they are),
and ``exp-config.yaml`` gives ``--tp``, ``--max-model-len``, ``--max-num-batched-tokens``,
``--max-num-seqs``, ``--gpu-memory-utilization``. BLIS runs it with

* ``trained-physics`` (BLIS's default, coefficients from its defaults.yaml),
* ``roofline``,
* ``stepsynth``: the archive entry, exported into a copy of the BLIS checkout
  (``translate_go.blis_export``; nothing in the checkout given is written),

every backend reading the same model config (the project's, written to a temporary
folder) and BLIS's H100 datasheet. Column SS-T replays instead the requests of the
project's own load plan (``blis replay`` of a TraceV2, ``load_trace``: one arrival stream
per stage, request ``i`` from user ``i mod users``, as the load generator sent them), so
that BLIS and the project's simulator see the same requests at the same offsets within
each stage (``load_trace`` says what still differs).

BLIS's per-request output (``--metrics-path``) is turned into what the load generator
measures: requests over the 300 s client timeout are failures, and each token arrives
as two streamed events, so the pooled ITL is ``sum(span) / sum(2N - 1)`` per request,
not BLIS's per-token interval. The project's own closed-loop simulation of the same
entry (``fitness.validate``) is column SS-P. Errors are predicted mean over observed
mean, minus 1.

Usage::

    python benchmarks/peers_blis.py --experiments ../shared/data/experiments --run-dir runs/r0
    python benchmarks/peers_blis.py --experiments DIR --run-dir RUN --id ENTRY --json out.json
    python benchmarks/peers_blis.py --experiments DIR --run-dir RUN --columns SS-T,SS-P --withheld

``--withheld`` runs the experiments without results instead (the blind ones): no errors,
the predictions of each column side by side, with the share of requests that failed.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from archive.rundir import RunDir, locate_archive  # noqa: E402
from archive.select import recommend  # noqa: E402
from archive.store import ArchiveStore  # noqa: E402
from evolve.cli_parser import OneLineParser, positive_int  # noqa: E402
from fitness.sim.loadgen import DEFAULT_EVENT_GAP_US, EVENTS_PER_TOKEN  # noqa: E402
from primitives.data.experiments import DEFAULT_REQUEST_TIMEOUT_S, find_experiments  # noqa: E402
from primitives.data.roots import shared_data_root  # noqa: E402
from primitives.errors import InputError  # noqa: E402

# column key -> (label, BLIS backend or None for the project's simulator, BLIS's workload):
# "spec" BLIS's own inference_perf expansion, "reuse" the same with each user's prompt
# reused, "trace" the project's load plan replayed (``blis replay``)
COLUMNS = {
    "TP": ("BLIS trained-physics", "trained-physics", "spec"),
    "RL": ("BLIS roofline", "roofline", "spec"),
    "SS-B": ("stepsynth in BLIS", "stepsynth", "spec"),
    "SS-R": ("stepsynth in BLIS, prompts reused", "stepsynth", "reuse"),
    "SS-T": ("stepsynth in BLIS, the load generator's requests", "stepsynth", "trace"),
    "SS-P": ("stepsynth in project", None, None),
}
METRICS = ("e2e", "ttft", "itl")
BLIS_GPU = "H100"


def workload_spec(spec, reuse: bool = False) -> dict:
    """BLIS's inference-perf workload of one experiment (results/config.yaml as parsed).

    REUSE: what the data shows the load generator did (NOTES.md §2): every user sends the
    same whole prompt each round, so BLIS gets one distinct system prompt of the full
    length per user and no question; BLIS's own expansion draws a new question per request.
    """
    shape = {
        "num_unique_system_prompts": spec.num_groups,
        "num_users_per_system_prompt": spec.num_prompts_per_group,
        "system_prompt_len": spec.system_prompt_len,
        "question_len": spec.question_len,
    }
    if reuse:
        shape = {
            "num_unique_system_prompts": spec.num_groups * spec.num_prompts_per_group,
            "num_users_per_system_prompt": 1,
            "system_prompt_len": spec.system_prompt_len + spec.question_len,
            "question_len": 0,
        }
    return {
        "version": "1",
        "seed": 0,
        "inference_perf": {
            "stages": [{"rate": float(r), "duration": int(d)} for r, d in spec.stages],
            "shared_prefix": {**shape, "output_len": spec.output_len, "enable_multi_turn_chat": False},
        },
    }


def client_means(requests: list[dict], injected: int, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> dict:
    """What the client would report from BLIS's per-request output (seconds).

    BLIS lists a request that timed out, or was still running at the horizon, with E2E
    and ITL 0 (and its TTFT if it had one).
    """
    ok = [r for r in requests if 0 < r["e2e_ms"] / 1e3 <= timeout_s and r["num_decode_tokens"] > 0]
    if not ok:
        return {"successes": 0, "failures": injected}
    gap_s = DEFAULT_EVENT_GAP_US / 1e6
    n = np.array([r["num_decode_tokens"] for r in ok], dtype=np.float64)
    itl = np.array([r["itl_ms"] for r in ok]) / 1e3
    span = itl * (n - 1) + gap_s  # first to last event: the tokens' intervals and the last gap
    return {
        "successes": len(ok),
        "failures": injected - len(ok),
        "e2e": float(np.mean([r["e2e_ms"] for r in ok])) / 1e3 + gap_s,
        "ttft": float(np.mean([r["ttft_ms"] for r in ok])) / 1e3,
        "itl": float(span.sum() / (EVENTS_PER_TOKEN * n - 1).sum()),
    }


def prepare_blis(source: Path, work: Path, entry, run_dir: Path, resolver) -> tuple[Path, Path]:
    """A copy of the checkout with the entry as backend ``stepsynth``, built; (checkout, binary)."""
    from translate_go.blis_export import export_blis
    from translate_go.targets import choose_deployment
    from translate_go.toolchain import run_go

    checkout = work / "blis"
    shutil.copytree(source, checkout, symlinks=True)
    subprocess.run(["chmod", "-R", "u+w", str(checkout)], check=True)
    deployment, _ = choose_deployment(entry, run_dir, resolver)
    _, changes = export_blis(entry, deployment, checkout, "stepsynth", resolver=resolver)
    print("\n".join(changes), file=sys.stderr)
    binary = work / "blis-bin"
    run_go(["build", "-o", str(binary), "."], checkout, env={"GOFLAGS": "-mod=vendor"}, timeout_s=1800)
    return checkout, binary


def model_folder(work: Path, spec, resolver) -> Path:
    """The project's config.json of the experiment's model, for every backend alike."""
    key = resolver.catalog.key_of(spec.model)
    cfg, _ = resolver.catalog.configs[key]
    folder = work / "models" / key
    folder.mkdir(parents=True, exist_ok=True)
    full = {"hidden_act": "silu", "max_position_embeddings": spec.max_model_len, **cfg}
    (folder / "config.json").write_text(json.dumps(full))
    return folder


# BLIS's TraceV2 data columns (sim/workload/tracev2.go), as ``blis run --trace-output`` writes them
TRACE_COLUMNS = (
    "request_id,client_id,tenant_id,slo_class,session_id,round_index,prefix_group,prefix_length,streaming,"
    "input_tokens,output_tokens,text_tokens,image_tokens,audio_tokens,video_tokens,reason_ratio,model,"
    "deadline_us,server_input_tokens,arrival_time_us,send_time_us,first_chunk_time_us,last_chunk_time_us,"
    "num_chunks,status,error_message,finish_reason"
).split(",")
TRACE_HEADER = {"trace_version": 3, "time_unit": "microseconds", "mode": "generated", "warm_up_requests": 0}
_ZERO_COLUMNS = ("round_index", "text_tokens", "image_tokens", "audio_tokens", "video_tokens", "reason_ratio")
_ZERO_COLUMNS += ("server_input_tokens", "first_chunk_time_us", "last_chunk_time_us", "num_chunks")
TRACE_ROW_DEFAULTS = (
    dict.fromkeys(TRACE_COLUMNS, "")
    | dict.fromkeys(_ZERO_COLUMNS, 0)
    | {"slo_class": "standard", "streaming": "true", "input_tokens": 1, "status": "ok"}
)


def load_trace(spec, seed: int = 0) -> tuple[dict, list[dict]]:
    """The requests of SPEC as the project's load generator sends them, as a BLIS TraceV2.

    ``fitness.sim.loadgen.build_load``'s plan (NOTES.md §2): one stream per stage, request
    ``i`` from user ``i mod users``, each user's whole re-tokenised prompt every time; so
    a user's prompt is its own prefix group (all but the last token, which vLLM always
    recomputes) and one fresh token. BLIS's own inference_perf expansion instead gives
    every user its own arrival stream, all of which end together at the stage's end.
    What still differs from the project's simulator: the stages follow each other after
    ``load.interval``, where the load generator (and the simulator) also waited for the
    previous stage to drain, about one E2E in runs that keep up; and a TraceV2 request has
    one prefix group, so the users of a group do not share its system prompt (a user's
    first request computes it again, some 6-9 blocks).
    Returns (header, rows).
    """
    from fitness.sim.loadgen import build_load

    plan = build_load(spec, seed)
    starts_s = np.concatenate([[0.0], np.cumsum([d + plan.stage_interval_s for _, d in spec.stages])])
    sends = np.concatenate([starts_s[k] + offs for k, offs in enumerate(plan.stage_offsets_s)])
    send_us = np.rint(sends * 1e6).astype(np.int64)
    timeout_us = round(plan.timeout_s * 1e6)
    rows = []
    for i, (user, prompt_len) in enumerate(zip(plan.request_user, plan.request_input_len, strict=True)):
        t, name = int(send_us[i]), f"user-{user}"
        request = {"request_id": i, "client_id": name, "tenant_id": name, "prefix_group": name}
        request |= {"prefix_length": int(prompt_len) - 1, "output_tokens": plan.output_len}
        request |= {"deadline_us": t + timeout_us, "arrival_time_us": t, "send_time_us": t}
        rows.append(TRACE_ROW_DEFAULTS | request)
    return {**TRACE_HEADER, "workload_seed": seed}, rows


def write_workload(work: Path, tag: str, spec, workload: str) -> list[str]:
    """BLIS's workload of SPEC written under WORK; the ``blis`` subcommand and its workload flags."""
    if workload != "trace":
        path = work / f"{tag}.yaml"
        path.write_text(yaml.safe_dump(workload_spec(spec, workload == "reuse"), sort_keys=False))
        return ["run", "--workload-spec", str(path), "--num-requests", str(spec.num_requests)]
    header, rows = load_trace(spec)
    header_path, data_path = work / f"{tag}.trace.yaml", work / f"{tag}.trace.csv"
    header_path.write_text(yaml.safe_dump(header, sort_keys=False))
    with data_path.open("w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=TRACE_COLUMNS)
        out.writeheader()
        out.writerows(rows)
    horizon_us = max(r["deadline_us"] for r in rows) + 1  # BLIS's default, twice the last send, can cut them off
    return ["replay", "--trace-header", str(header_path), "--trace-data", str(data_path), "--horizon", str(horizon_us)]


def blis_command(binary: Path, work: Path, spec, backend: str, workload: str, resolver) -> tuple[list[str], Path]:
    """The BLIS command line of one experiment, its workload written; (command, metrics path)."""
    tag = f"{spec.name}-{backend}" + ("" if workload == "spec" else f"-{workload}")
    metrics_path = work / f"{tag}.json"
    cmd = [
        *(str(binary), *write_workload(work, tag, spec, workload)),
        *("--model", spec.model.lower(), "--tp", str(spec.tp), "--hardware", BLIS_GPU),
        *("--model-config-folder", str(model_folder(work, spec, resolver)), "--latency-model", backend),
        *("--max-model-len", str(spec.max_model_len), "--max-num-batched-tokens", str(spec.max_num_batched_tokens)),
        *("--max-num-seqs", str(spec.max_num_seqs), "--gpu-memory-utilization", str(spec.gpu_memory_utilization)),
        *("--metrics-path", str(metrics_path)),
    ]
    if workload != "trace":  # a trace gives each request its deadline
        cmd += ["--timeout", str(int(spec.request_timeout_s))]
    return cmd, metrics_path


def run_blis(binary: Path, checkout: Path, work: Path, spec, backend: str, workload: str, resolver) -> dict:
    cmd, metrics_path = blis_command(binary, work, spec, backend, workload, resolver)
    proc = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0 or not metrics_path.exists():
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[0][:200]}
    out = json.loads(metrics_path.read_text())
    return client_means(out.get("requests") or [], int(out.get("injected_requests", 0)), spec.request_timeout_s)


def errors(pred: dict, obs) -> dict:
    return {m: (pred[m] / getattr(obs, f"{m}_mean_s") - 1.0) if pred.get(m) is not None else None for m in METRICS}


def compare_all(
    specs: list,
    run_dir: Path,
    entry_id: str | None,
    blis_src: Path,
    jobs: int,
    keep: Path | None = None,
    columns: tuple[str, ...] = tuple(COLUMNS),
) -> list[dict]:
    """Each column's predictions for SPECS (all with results, or all withheld), one row each."""
    from fitness.validate import ClosedLoopSettings, closed_loop_runs, same_model
    from primitives.deployment import default_resolver

    resolver = default_resolver()
    with ArchiveStore(RunDir(run_dir).archive, create=False) as store:
        entry = store.get(entry_id) if entry_id else recommend(store.front())
    which = "without results (withheld)" if specs[0].observed is None else "with results"
    print(f"entry {entry.id}: {entry.expression}\n{len(specs)} experiments {which}", file=sys.stderr)
    project = {}
    if "SS-P" in columns:
        runs = same_model(specs, entry.expression, entry.overheads)
        items = closed_loop_runs(runs, resolver, ClosedLoopSettings(jobs=jobs))
        project = {it["name"]: it for it in items}
    rows = []
    with tempfile.TemporaryDirectory(prefix="peers-blis-") as tmp:
        work = Path(tmp) if keep is None else keep
        checkout, binary = prepare_blis(blis_src, work, entry, run_dir, resolver)
        for spec in specs:
            obs = spec.observed.summary if spec.observed is not None else None
            row = {"experiment": spec.name, "entry": entry.id, "observed": obs.as_dict() if obs else None}
            row["requests"] = spec.num_requests
            for key in columns:
                _, backend, workload = COLUMNS[key]
                if backend is None:
                    item = project[spec.name]
                    pred = {m: item.get(f"{m}_mean_pred_s") for m in METRICS} | {"failures": item.get("failures_pred")}
                else:
                    pred = run_blis(binary, checkout, work, spec, backend, workload, resolver)
                row[key] = {**pred, "errors": errors(pred, obs) if obs else None}
                print(f"{spec.name} {key}: {pred}", file=sys.stderr)
            rows.append(row)
    return rows


def _pct(v) -> str:
    return "—" if v is None else f"{100 * v:+.1f}%"


def print_table(rows: list[dict]) -> None:
    keys = [k for k in COLUMNS if rows and k in rows[0]]
    print("Error of the mean (predicted / observed - 1); " + ", ".join(f"{k}: {COLUMNS[k][0]}" for k in keys) + ".\n")
    head = " | ".join(f"{m.upper()} {k}" for m in METRICS for k in keys)
    print(f"| experiment | {head} |")
    print("|---|" + "---|" * (len(METRICS) * len(keys)))
    for row in rows:
        cells = [_pct(row[k]["errors"][m]) for m in METRICS for k in keys]
        print(f"| {row['experiment']} | " + " | ".join(cells) + " |")
    means = []
    for m in METRICS:
        for k in keys:
            vals = [abs(r[k]["errors"][m]) for r in rows if r[k]["errors"][m] is not None]
            means.append(f"{100 * np.mean(vals):.1f}%" if vals else "—")
    print("| mean abs error | " + " | ".join(means) + " |")
    pairs = [(b, "SS-P") for b in ("SS-B", "SS-R", "SS-T") if b in keys and "SS-P" in keys]
    for b, p in pairs:
        print(f"\nSame model, {COLUMNS[b][0]} against the project's simulator ({b} / SS-P - 1), and failures:")
        for row in rows:
            x, y = row[b], row[p]
            diff = [_pct(x[m] / y[m] - 1) if x.get(m) and y.get(m) else "—" for m in METRICS]
            obs_fail = row["observed"]["failures"]
            fails = f"failures BLIS {x.get('failures')}, project {y.get('failures')}, observed {obs_fail}"
            print(f"  {row['experiment']}: E2E {diff[0]}, TTFT {diff[1]}, ITL {diff[2]}; {fails}")


def print_predictions(rows: list[dict]) -> None:
    """The withheld experiments: each column's means and failed share, no observed figures."""
    keys = [k for k in COLUMNS if rows and k in rows[0]]
    print("Predictions (no results to compare with): E2E s / TTFT s / ITL ms / failed; ", end="")
    print(", ".join(f"{k}: {COLUMNS[k][0]}" for k in keys) + ".\n")
    print("| experiment | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for row in rows:
        cells = []
        for k in keys:
            pred = row[k]
            if pred.get("error") or pred.get("failures") is None:
                cells.append(str(pred.get("error", "—")).replace("|", "/"))
                continue
            # BLIS's own workload expansion (SS-B, SS-R) may inject another count than the plan's
            total = pred["successes"] + pred["failures"] if "successes" in pred else row["requests"]
            means = " / ".join("—" if pred.get(m) is None else f"{pred[m] * s:.{d}f}" for m, s, d in _SHOWN)
            cells.append(f"{means} / {100 * pred['failures'] / total:.1f}%" if total else means)
        print(f"| {row['experiment']} | " + " | ".join(cells) + " |")


_SHOWN = (("e2e", 1.0, 1), ("ttft", 1.0, 1), ("itl", 1e3, 2))  # metric, scale to the unit shown, decimals


def merged_rows(paths: list[Path]) -> list[dict]:
    """The rows of earlier --json outputs, side by side; InputError naming a file that is not one."""
    parts = []
    for path in paths:
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise InputError(path, "--merge", f"cannot read it ({e.strerror})") from None
        except UnicodeDecodeError:
            raise InputError(path, "--merge", "not UTF-8 text; expected what --json writes") from None
        except json.JSONDecodeError as e:
            raise InputError(
                path, "--merge", f"not JSON ({e.msg}, line {e.lineno}); expected what --json writes"
            ) from None
        bad = _merge_problem(rows)
        if bad:
            raise InputError(path, "--merge", f"{bad}; expected the rows --json writes")
        names = [r["experiment"] for r in rows]
        if parts and names != [r["experiment"] for r in parts[0]]:
            raise InputError(path, "--merge", f"other experiments than {paths[0]}; expected the same ones")
        parts.append(rows)
    return [{k: v for part in row_parts for k, v in part.items()} for row_parts in zip(*parts, strict=True)]


def _merge_problem(rows) -> str | None:
    """What keeps ROWS from being a --json output (None: nothing): rows of one kind (with
    results, or withheld), each with the same columns."""
    if not isinstance(rows, list) or not rows:
        return "not a list of rows" if not isinstance(rows, list) else "no rows"
    kinds, columns = set(), None
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("experiment"), str):
            return f"row {i} has no experiment"
        withheld = "observed" in row and row["observed"] is None
        kinds.add(withheld)
        if withheld and type(row.get("requests")) is not int:
            return f"row {i} (withheld) has no request count"
        if not withheld and (not isinstance(row.get("observed"), dict) or "failures" not in row["observed"]):
            return f"row {i} has no observed figures"
        keys = [k for k in COLUMNS if k in row]
        columns = keys if columns is None else columns
        if keys != columns or len(kinds) > 1:
            return f"row {i} differs from row 0 in its " + ("columns" if keys != columns else "kind (withheld or not)")
        for key in keys:
            bad = _prediction_problem(row[key]) if withheld else _errors_problem(row[key])
            if bad:
                return f"row {i}: {key} {bad}"
    return None


def _number(v) -> bool:
    return v is None or type(v) in (int, float)


def _errors_problem(column) -> str | None:
    errors = column.get("errors") if isinstance(column, dict) else None
    if not isinstance(errors, dict) or not all(m in errors and _number(errors[m]) for m in METRICS):
        return f"has no errors of {', '.join(METRICS)}"
    return None


def _prediction_problem(column) -> str | None:
    if isinstance(column, dict) and isinstance(column.get("error"), str):
        return None
    if not isinstance(column, dict) or not all(_number(column.get(m)) for m in METRICS):
        return f"has no predictions of {', '.join(METRICS)}"
    if not (column.get("failures") is None or type(column["failures"]) is int):
        return "has no failure count"
    return None


def check_inputs(args) -> list:
    """Every input and output of a comparison, before the slow simulations and BLIS's build;
    the experiments to run (those with results, or those without for ``--withheld``)."""
    from evolve.cli_files import check_writable_file
    from translate_go.blis_checkout import check_checkout

    if args.run_dir.is_file():
        raise InputError(args.run_dir, "--run-dir", "expected a run directory (not its archive file)")
    with ArchiveStore(locate_archive(args.run_dir), create=False, read_only=True) as store:
        try:
            if args.id:
                store.get(args.id)
            else:
                recommend(store.front())
        except ValueError as exc:  # no front to recommend from
            raise InputError(args.run_dir, "--run-dir", f"no recommended entry ({exc}); pass --id") from None
    try:
        specs = [s for s in find_experiments(args.experiments) if (s.observed is None) == args.withheld]
    except InputError as err:
        raise InputError(err.path, err.field, f"{err.expected} (--experiments)") from None
    if not specs:
        which = "without results (--withheld)" if args.withheld else "with results (or pass --withheld)"
        raise InputError(args.experiments, "--experiments", f"expected experiments {which}")
    check_checkout(args.blis)  # built whatever the columns
    if args.work is not None and args.work.exists() and (not args.work.is_dir() or any(args.work.iterdir())):
        raise InputError(args.work, "--work", "expected a new (or empty) folder")
    check_writable_file(args.json, "--json")
    return specs


def main(argv=None) -> int:
    ap = OneLineParser(prog="python benchmarks/peers_blis.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiments", type=Path, metavar="DIR")
    ap.add_argument("--run-dir", type=Path, metavar="RUN", help="run directory holding the entry")
    ap.add_argument("--id", metavar="ENTRY", help="archive entry (default: the run's recommended one)")
    ap.add_argument("--blis", type=Path, default=shared_data_root() / "blis", metavar="CHECKOUT", help="read only")
    ap.add_argument("--jobs", type=positive_int, default=2, metavar="J")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write every figure here")
    ap.add_argument("--work", type=Path, metavar="DIR", help="keep BLIS's copy, specs and outputs here (new folder)")
    ap.add_argument("--columns", default=",".join(COLUMNS), help=f"some of {','.join(COLUMNS)} (default: all)")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="JSON", help="only print earlier --json outputs together")
    ap.add_argument("--withheld", action="store_true", help="the experiments without results: predictions only")
    args = ap.parse_args(argv)
    columns = tuple(c.strip() for c in args.columns.split(","))
    unknown = sorted(set(columns) - set(COLUMNS))
    if unknown:
        ap.error(f"unknown --columns {unknown}; expected some of {list(COLUMNS)}")
    if not args.merge and (args.experiments is None or args.run_dir is None):
        ap.error("--experiments and --run-dir are required")
    try:
        if args.merge:  # print the table of earlier --json outputs side by side
            rows = merged_rows(args.merge)
            (print_predictions if rows[0]["observed"] is None else print_table)(rows)
            return 0
        specs = check_inputs(args)
        rows = compare_all(specs, args.run_dir, args.id, args.blis, args.jobs, args.work, columns)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    (print_predictions if args.withheld else print_table)(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
