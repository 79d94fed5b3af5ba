"""`python -m evolve run`: load data, search, archive the front every few generations."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from archive.store import ArchiveStore, RunDir, default_run_dir, record_latest
from fitness.dataset import build_step_table
from fitness.scoring import FitnessContext
from primitives.deployment import DeploymentResolver
from primitives.errors import InputError
from primitives.registry import supported_primitives
from primitives.traces import default_data_dir, load_steps

from .config import RunConfig
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
    """Data -> primitive columns (and replay rows) -> the fitness context."""
    paths = config.data or [str(default_data_dir())]
    data = load_steps([Path(p) for p in paths])
    names = supported_primitives(data.available_features)
    table = build_step_table(data, resolver, names, config.validation_fraction)
    replay = None
    if config.experiments:
        from fitness.replay_context import build_replay_rows

        replay = build_replay_rows(Path(config.experiments), resolver, table, names, config)
    return FitnessContext(table, replay), names, data


def run_search(config: RunConfig, ui) -> list:
    if config.resume:
        config = _resume_config(config)
    resolver = DeploymentResolver.from_options(
        Path(config.model_configs) if config.model_configs else None,
        Path(config.gpu_datasheet) if config.gpu_datasheet else None,
    )
    ctx, names, data = prepare_context(config, resolver)
    fingerprint = ctx.steps.fingerprint

    root = Path(config.run_dir) if config.run_dir else default_run_dir(config.seed)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(root, "--run-dir", f"cannot create the run directory ({exc.strerror})") from None
    if not os.access(root, os.W_OK):
        raise InputError(root, "--run-dir", "the run directory is not writable")
    run_dir = RunDir(root)
    run_id = root.name
    config.run_dir = str(root)
    if not config.resume:
        _atomic_write_json(root / RUN_CONFIG_NAME, config.to_dict())
    record_latest(root)
    meta = {"run_id": run_id, "fingerprint": fingerprint, "seed": config.seed, "config": config.to_dict()}

    with ArchiveStore(run_dir.archive) as store:
        store.start_run(run_id, config.to_dict(), config.seed, fingerprint)
        with Evaluator(ctx, config.jobs, config.backend, config.scheduler) as evaluator:
            search = Search(config, ctx, names, evaluator)
            t0 = time.perf_counter()
            if config.resume and (root / CHECKPOINT_NAME).is_file():
                search.load_checkpoint(root)
                ui.log(f"resumed {root} at generation {search.state.generation}")
            else:
                search.initialise()
                search.save_checkpoint(root)
            ui.start(config.generations, config.time_limit_s)
            evals_at, time_at = search.state.evaluations, time.perf_counter()
            status = "finished"
            try:
                while search.state.generation < config.generations:
                    if config.time_limit_s is not None and time.perf_counter() - t0 >= config.time_limit_s:
                        status = "time-limit"
                        break
                    search.step()
                    now = time.perf_counter()
                    rate = (search.state.evaluations - evals_at) / max(now - time_at, 1e-9)
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
            entries = _record(store, search, meta)
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


def _record(store: ArchiveStore, search: Search, meta: dict) -> list:
    """Write the current front and the best entry at each complexity, in one transaction."""
    front = [_entry(search, p, s, meta) for p, s in search.front()]
    best = [_entry(search, p, s, meta) for p, s in search.hall_items()]
    stats = {"evaluations": search.state.evaluations, "best_error": search.best_error()}
    store.record_generation(meta["run_id"], search.state.generation, front, best, stats)
    return front


_ENTRY_CACHE: dict[tuple[str, str], object] = {}


def _entry(search: Search, program, score, meta: dict):
    """Archive entries are built once per candidate: sympy simplification is slow."""
    from .expression import canonical

    key = canonical(program)
    cache_key = (meta["run_id"], key)
    if cache_key not in _ENTRY_CACHE:
        _ENTRY_CACHE[cache_key] = entry_from(program, score, search.state.first_seen.get(key, 0), meta)
    return _ENTRY_CACHE[cache_key]
