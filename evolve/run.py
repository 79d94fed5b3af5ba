"""`python -m evolve run`: load data, search, archive the front every few generations."""
from __future__ import annotations

import json
import os
import time

import numpy as np
from pathlib import Path

from archive.store import ArchiveStore, RunDir, default_run_dir, record_latest
from fitness.dataset import build_step_table
from fitness.scoring import FitnessContext
from primitives.deployment import DeploymentResolver
from primitives.errors import InputError, writable_dir
from primitives.registry import supported_primitives
from primitives.data.roots import default_data_dir
from primitives.data.traces import load_steps

from .config import RunConfig
from primitives.language import linear_model_sympy, to_infix
from .search import CHECKPOINT_NAME, Evaluator, Search, entry_from

RUN_CONFIG_NAME = "run.json"


def _atomic_write_json(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _resume_config(config: RunConfig) -> RunConfig:
    """A resumed run keeps its own configuration; only the stopping rules may change."""
    root = Path(config.resume)
    saved = root / RUN_CONFIG_NAME
    if not saved.is_file():
        raise InputError(root, "--resume", f"not a run directory (no {RUN_CONFIG_NAME})")
    old = RunConfig.from_dict(json.loads(saved.read_text()))
    old.resume = str(root)
    old.run_dir = str(root)
    old.jobs = config.jobs
    old.backend = config.backend
    old.scheduler = config.scheduler
    if config.generations and config.generations > old.generations:
        old.generations = config.generations
    old.time_limit_s = config.time_limit_s
    return old


def prepare_context(config: RunConfig, resolver: DeploymentResolver):
    """Data -> primitive columns -> the fitness context (replay rows come separately)."""
    paths = config.data or [str(default_data_dir())]
    data = load_steps([Path(p) for p in paths])
    names = supported_primitives(data.available_features)
    table = build_step_table(data, resolver, names, config.validation_fraction)
    return FitnessContext(table, None, config.replay_weight), names, data


def replay_rows_for(config: RunConfig, resolver: DeploymentResolver, ctx: FitnessContext, names: list[str],
                    replay_model: tuple[str, dict] | None, ui):
    """Replay rows from the closed loop of ``replay_model``, or calibrated from scratch.

    Calibration: the reference physics records first trajectories; the best seed is
    fitted on them and drives the closed loop again, ``calibration_rounds`` times, so
    the search starts from batches close to what a fitted model produces.
    Returns (rows, the model that recorded them).
    """
    from fitness.replay_context import build_replay_rows, refresh_replay_rows

    exp_dir = Path(config.experiments)
    if replay_model is not None:
        ui.log("re-recording trajectories of the checkpointed replay model")
        return refresh_replay_rows(exp_dir, resolver, _model_entry(replay_model), names, config.seed, config.jobs), replay_model
    ui.log("recording reference trajectories (closed loop, every experiment)")
    rows = build_replay_rows(exp_dir, resolver, ctx.steps, names, config)
    recorded_by: tuple[str, dict] | None = None
    _, score = _best_seed(FitnessContext(ctx.steps, rows, config.replay_weight), names)
    best = (score.replay_error, rows, recorded_by)
    for r in range(config.calibration_rounds):
        model = _replay_model_of(score)
        ui.log(f"calibration {r + 1}/{config.calibration_rounds}: best seed's replay error {score.replay_error:.3f};"
               " re-recording with it")
        rows = refresh_replay_rows(exp_dir, resolver, _model_entry(model), names, config.seed, config.jobs)
        _, score = _best_seed(FitnessContext(ctx.steps, rows, config.replay_weight), names)
        if not score.replay_error < best[0]:
            # near saturation the fixed point can overshoot: keep the better trajectories
            ui.log(f"calibration {r + 1}: replay error {score.replay_error:.3f} is no better; keeping the previous")
            break
        best = (score.replay_error, rows, model)
    return best[1], best[2]


def _replay_model_of(score) -> tuple[str, dict]:
    """(expression, overheads) of a scored candidate: what drives a closed loop."""
    return to_infix(linear_model_sympy(score.terms, score.coefficients, score.intercept)), dict(score.overheads)


def _model_entry(replay_model: tuple[str, dict]):
    """What the closed loop needs of a model: its expression and overheads."""
    from types import SimpleNamespace

    return SimpleNamespace(expression=replay_model[0], overheads=replay_model[1])


def _best_seed(ctx: FitnessContext, names: list[str]):
    from fitness.scoring import score_program

    from .search import build_pset, search_error, seed_trees, tree_to_program

    programs = [tree_to_program(t) for t in seed_trees(names, build_pset(names))]
    return min(((p, score_program(p, ctx)) for p in programs), key=lambda it: search_error(it[1]))


def run_search(config: RunConfig, ui) -> list:
    if config.resume:
        config = _resume_config(config)
    else:  # run.json must work from any directory, for --resume
        config.data = [str(Path(p).resolve()) for p in config.data]
        for name in ("experiments", "model_configs", "gpu_datasheet"):
            if getattr(config, name):
                setattr(config, name, str(Path(getattr(config, name)).resolve()))
    resolver = DeploymentResolver.from_options(
        Path(config.model_configs) if config.model_configs else None,
        Path(config.gpu_datasheet) if config.gpu_datasheet else None,
    )
    ctx, names, data = prepare_context(config, resolver)
    fingerprint = ctx.steps.fingerprint
    if config.experiments:
        fingerprint = f"{fingerprint}+{_experiments_fingerprint(Path(config.experiments))}"

    root = writable_dir(Path(config.run_dir) if config.run_dir else default_run_dir(config.seed), "--run-dir")
    run_dir = RunDir(root)
    run_id = root.name
    config.run_dir = str(root)
    if not config.resume:
        _atomic_write_json(root / RUN_CONFIG_NAME, config.to_dict())
    meta = {"run_id": run_id, "fingerprint": fingerprint, "seed": config.seed, "config": config.to_dict()}

    # the pool (or the Dask connection) first: a bad --scheduler leaves no half-started run
    with Evaluator(ctx, config.jobs, config.backend, config.scheduler) as evaluator, \
            ArchiveStore(run_dir.archive) as store:
        store.start_run(run_id, config.to_dict(), config.seed, fingerprint)
        record_latest(root)
        t0 = time.perf_counter()
        resuming = bool(config.resume) and (root / CHECKPOINT_NAME).is_file()
        replay_model = None
        if config.experiments:
            saved = Search.peek_checkpoint(root).replay_model if resuming else None
            rows, replay_model = replay_rows_for(config, resolver, ctx, names, saved, ui)
            ctx = FitnessContext(ctx.steps, rows, config.replay_weight)
            evaluator.reset(ctx)
        search = Search(config, ctx, names, evaluator)
        if resuming:
            search.load_checkpoint(root)
            ui.log(f"resumed {root} at generation {search.state.generation}")
        else:
            search.initialise()
            search.state.replay_model = replay_model
            search.save_checkpoint(root)
        ui.start(config.generations, config.time_limit_s)
        # the progress line's rate is the search's own: trajectory refreshes are not in it
        evals_at, search_s = search.state.evaluations, 0.0
        status = "finished"
        try:
            while search.state.generation < config.generations:
                if config.time_limit_s is not None and time.perf_counter() - t0 >= config.time_limit_s:
                    status = "time-limit"
                    break
                step_t0 = time.perf_counter()
                search.step()
                search_s += time.perf_counter() - step_t0
                if config.experiments and search.state.generation % _refresh_every(config) == 0 \
                        and search.state.generation < config.generations:
                    _refresh(search, config, resolver, names, ui)
                rate = (search.state.evaluations - evals_at) / max(search_s, 1e-9)
                ui.update(search.state.generation, search.best_error(), len(search.front()), rate)
                if search.state.generation % max(config.checkpoint_every, 1) == 0:
                    _record(store, search, meta)
                    search.save_checkpoint(root)
        except KeyboardInterrupt:
            # keep what the finished generations found; the checkpoint allows --resume
            _record(store, search, meta)
            search.save_checkpoint(root)
            store.finish_run(run_id, {"generations": search.state.generation}, status="interrupted")
            raise
        entries = _record(store, search, meta, final=True)
        if config.experiments and config.closed_loop_checks > 0:
            entries = _closed_loop_check(store, search, meta, entries, config, resolver, ui)
        search.save_checkpoint(root)
        summary = {
            "generations": search.state.generation,
            "evaluations": search.state.evaluations,
            "unique_candidates": len(evaluator.memo),
            "wall_time_s": round(time.perf_counter() - t0, 2),
            "front_size": len(entries),
            "status": status,
            "dataset_fingerprint": fingerprint,
            "primitives": names,
            "run_dir": str(root),
        }
        store.finish_run(run_id, summary, status="finished" if status == "finished" else "interrupted")
    ui.finish(entries, summary)
    return entries


def _refresh_every(config: RunConfig) -> int:
    return config.refresh_every or max(config.generations // 3, 1)


def _refresh(search: Search, config: RunConfig, resolver, names: list[str], ui) -> None:
    """Re-record the trajectories with the current best model (closed loop), rescore."""
    from fitness.replay_context import refresh_replay_rows

    model = _replay_model_of(search.best_item()[1])
    ui.log(f"generation {search.state.generation}: refreshing trajectories with the current best model")
    rows = refresh_replay_rows(Path(config.experiments), resolver, _model_entry(model), names, config.seed, config.jobs)
    search.replace_context(FitnessContext(search.ctx.steps, rows, config.replay_weight))
    search.state.replay_model = model


def _closed_loop_check(store, search: Search, meta: dict, front: list, config: RunConfig, resolver, ui) -> list:
    """Validate the most promising front entries in the closed loop; store those errors.

    The search's replay errors are first-order estimates around recorded batches; near
    saturation (the 128-slot cap) the closed loop can still depart from them. The entries
    with the lowest estimated replay error (every replayed row, stages included: the stage
    rows say how latency grows with load) are re-scored on the closed-loop E2E/TTFT/ITL of
    every experiment with results (the estimates are kept as ``*_error_search_estimate``),
    and ``archive best`` prefers them.
    """
    from fitness.replay_context import scored_experiments
    from fitness.validate import closed_loop_items

    specs = scored_experiments(Path(config.experiments))
    chosen = sorted(front, key=lambda e: (e.objectives.get("replay_error", np.inf), e.complexity))
    chosen = chosen[: config.closed_loop_checks]
    for e in chosen:
        ui.log(f"closed-loop check of {e.id} (complexity {e.complexity}) on {len(specs)} experiments")
        items = closed_loop_items(specs, resolver, e.expression, e.overheads, config.seed, config.jobs)
        for m in ("e2e", "ttft", "itl"):
            errs = [abs(i[f"{m}_error"]) for i in items if i[f"{m}_error"] is not None]
            e.objectives[f"{m}_error_search_estimate"] = e.objectives.get(f"{m}_error")  # linearised replay
            e.objectives[f"{m}_error"] = float(np.mean(errs))
            e.objectives[f"{m}_error_max"] = float(np.max(errs))
        e.objectives["closed_loop"] = 1.0
        for i in items:
            e.per_experiment.setdefault(i["name"], {}).update(
                {f"{m}_error_closed_loop": i[f"{m}_error"] for m in ("e2e", "ttft", "itl")})
    stats = {"evaluations": search.state.evaluations, "closed_loop_checked": [e.id for e in chosen]}
    best = [_entry(search, p, s, meta) for p, s in search.hall_items()]
    store.record_generation(meta["run_id"], search.state.generation, front, best, stats)
    return front


def _experiments_fingerprint(directory: Path) -> str:
    """Names and observed results of the experiments the run is scored against."""
    import hashlib

    from fitness.replay_context import scored_experiments

    h = hashlib.sha256()
    for spec in scored_experiments(directory):
        h.update(repr((spec.name, spec.model, spec.tp, spec.stages, spec.observed)).encode())
    return h.hexdigest()[:12]


def _record(store: ArchiveStore, search: Search, meta: dict, final: bool = False) -> list:
    """Write the current front and the best entry at each complexity, in one transaction.

    The final record adds the sympy-simplified form to the front's entries."""
    front = [_entry(search, p, s, meta, simplify=final) for p, s in search.front()]
    best = [_entry(search, p, s, meta) for p, s in search.hall_items()]
    stats = {"evaluations": search.state.evaluations, "best_error": search.best_error()}
    store.record_generation(meta["run_id"], search.state.generation, front, best, stats)
    return front


def _entry(search: Search, program, score, meta: dict, simplify: bool = False):
    """Archive entries are built once per candidate and context (and once more simplified)."""
    from primitives.language import canonical

    key = (canonical(program), id(search.ctx), simplify)
    if key not in search.entries:
        search.entries[key] = entry_from(program, score, search.state.first_seen.get(key[0], 0), meta, simplify)
    return search.entries[key]
