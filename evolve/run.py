"""`python -m evolve run`: load data, search, archive the front every few generations.

The run is put together the way pymoo separates problem, algorithm, termination and
callbacks: the fitness context is the problem, ``Search`` the algorithm, a
``Termination`` says when to stop (generations, time limit), and callbacks act after
every generation, in order: trajectory refresh, progress, archiving, checkpointing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from archive.rundir import RunDir, default_run_dir, record_latest
from archive.store import ArchiveStore
from evolve.calibration import calibrated_replay_rows, experiments_fingerprint, refresh_every, refresh_trajectories
from evolve.config import RunConfig
from evolve.evaluator import Evaluator
from evolve.records import best_entries, record_front
from evolve.search import Search
from evolve.validation import closed_loop_check
from fitness.dataset import build_step_table
from fitness.kv_sharing import trace_kv_sharing
from fitness.physics_probes import PhysicsProbes
from fitness.scoring import FitnessContext
from fitness.sim.loadgen import check_servable
from primitives.data.experiments import find_experiments
from primitives.data.roots import default_data_dir
from primitives.data.traces import load_steps
from primitives.deployment import DeploymentResolver
from primitives.errors import InputError, writable_dir
from primitives.files import atomic_write_json, read_mapping
from primitives.registry import supported_primitives


# -- termination and callbacks ------------------------------------------------------------
@dataclass
class Termination:
    """When the run stops: after ``generations``, or once ``time_limit_s`` has passed since it started."""

    generations: int
    time_limit_s: float | None = None
    started_at: float = field(default_factory=time.perf_counter)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started_at

    def reason(self, generation: int) -> str | None:
        """Why the run stops before the next generation ("finished", "time-limit"), or None to go on."""
        if generation >= self.generations:
            return "finished"
        if self.time_limit_s is not None and self.elapsed_s() >= self.time_limit_s:
            return "time-limit"
        return None


class TrajectoryRefresh:
    """Every few generations (never after the last), re-record the replay trajectories with the best model."""

    def __init__(self, config: RunConfig, resolver: DeploymentResolver, names: list[str], ui):
        self.config, self.resolver, self.names, self.ui = config, resolver, names, ui

    def on_generation(self, search: Search, step_s: float) -> None:
        generation = search.state.generation
        if generation % refresh_every(self.config) == 0 and generation < self.config.generations:
            refresh_trajectories(search, self.config, self.resolver, self.names, self.ui)


class Progress:
    """The progress line; its rate is the search's own (trajectory refreshes are not in it)."""

    def __init__(self, ui, search: Search):
        self.ui = ui
        self.evaluations_at = search.state.evaluations
        self.search_s = 0.0

    def on_generation(self, search: Search, step_s: float) -> None:
        self.search_s += step_s
        rate = (search.state.evaluations - self.evaluations_at) / max(self.search_s, 1e-9)
        self.ui.update(search.state.generation, search.best_error(), len(search.front()), rate)


class Archiver:
    """Every ``every`` generations, the front and the best entry per complexity go to the archive."""

    def __init__(self, store: ArchiveStore, meta: dict, every: int):
        self.store, self.meta, self.every = store, meta, max(every, 1)

    def record(self, search: Search) -> list:
        return record_front(self.store, search, self.meta)

    def on_generation(self, search: Search, step_s: float) -> None:
        if search.state.generation % self.every == 0:
            self.record(search)


class Checkpointer:
    """Every ``every`` generations, the search state goes to the run's checkpoint (for ``--resume``)."""

    def __init__(self, path: Path, every: int):
        self.path, self.every = path, max(every, 1)

    def save(self, search: Search) -> None:
        search.save_checkpoint(self.path)

    def on_generation(self, search: Search, step_s: float) -> None:
        if search.state.generation % self.every == 0:
            self.save(search)


def run_generations(search: Search, termination: Termination, callbacks: list) -> str:
    """Step the search until ``termination`` says why it stops; call every callback after each generation."""
    while (status := termination.reason(search.state.generation)) is None:
        step_t0 = time.perf_counter()
        search.step()
        step_s = time.perf_counter() - step_t0
        for callback in callbacks:
            callback.on_generation(search, step_s)
    return status


# -- the run ------------------------------------------------------------------------------
def _resume_config(config: RunConfig) -> RunConfig:
    """A resumed run keeps its own configuration; only the stopping rules may change."""
    root = Path(config.resume)
    saved = RunDir(root).run_config
    if not saved.is_file():
        raise InputError(root, "--resume", f"not a run directory (no {saved.name})")
    old = RunConfig.from_dict(read_mapping(saved, "json"))
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
    kv_sharing = trace_kv_sharing(data, config.experiments, resolver, config.seed)
    table = build_step_table(data, resolver, names, config.validation_fraction, kv_sharing)
    deployments = list(table.deployments)
    if config.experiments:  # the replayed experiments' deployments are probed too
        for spec in find_experiments(Path(config.experiments)):
            dep = resolver.resolve_experiment(spec)
            if spec.observed is not None:  # scored: fail now, not after the run directory is made
                check_servable(spec, dep)
            if dep not in deployments:
                deployments.append(dep)
    ctx = FitnessContext(
        table,
        None,
        config.replay_weight,
        efficiency_bounds=tuple(config.efficiency_bounds),
        probes=PhysicsProbes.build(deployments, names, floor_fraction=config.efficiency_bounds[0]),
    )
    return ctx, names, data


def run_search(config: RunConfig, ui) -> list:
    if config.resume:
        config = _resume_config(config)
    else:  # run.json must work from any directory, for --resume
        config.data = [str(Path(p).resolve()) for p in config.data]
        for name in ("experiments", "model_configs", "gpu_datasheet", "kernels"):
            if getattr(config, name):
                setattr(config, name, str(Path(getattr(config, name)).resolve()))
    resolver = DeploymentResolver.from_options(
        *(Path(v) if v else None for v in (config.model_configs, config.gpu_datasheet, config.kernels))
    )
    ctx, names, data = prepare_context(config, resolver)
    fingerprint = ctx.steps.fingerprint
    if config.experiments:
        fingerprint = f"{fingerprint}+{experiments_fingerprint(Path(config.experiments))}"

    root = writable_dir(Path(config.run_dir) if config.run_dir else default_run_dir(config.seed), "--run-dir")
    run_dir = RunDir(root)
    run_id = root.name
    config.run_dir = str(root)
    if not config.resume:
        atomic_write_json(run_dir.run_config, config.to_dict(), indent=2, sort_keys=True)
    meta = {"run_id": run_id, "fingerprint": fingerprint, "seed": config.seed, "config": config.to_dict()}

    # the pool (or the Dask connection) first: a bad --scheduler leaves no half-started run
    with (
        Evaluator(ctx, config.jobs, config.backend, config.scheduler) as evaluator,
        ArchiveStore(run_dir.archive) as store,
    ):
        store.start_run(run_id, config.to_dict(), config.seed, fingerprint)
        record_latest(root)
        termination = Termination(config.generations, config.time_limit_s)
        resuming = bool(config.resume) and run_dir.checkpoint.is_file()
        replay_model = None
        if config.experiments:
            saved = Search.peek_checkpoint(run_dir.checkpoint).replay_model if resuming else None
            rows, replay_model = calibrated_replay_rows(config, resolver, ctx, names, saved, ui)
            ctx = replace(ctx, replay=rows)
            evaluator.reset(ctx)
        search = Search(config, ctx, names, evaluator)
        if resuming:
            search.load_checkpoint(run_dir.checkpoint)
            ui.log(f"resumed {root} at generation {search.state.generation}")
        else:
            search.initialise()
            search.state.replay_model = replay_model
            search.save_checkpoint(run_dir.checkpoint)
        ui.start(config.generations, config.time_limit_s)
        archiver = Archiver(store, meta, config.checkpoint_every)
        checkpointer = Checkpointer(run_dir.checkpoint, config.checkpoint_every)
        callbacks = [Progress(ui, search), archiver, checkpointer]
        if config.experiments:
            callbacks.insert(0, TrajectoryRefresh(config, resolver, names, ui))
        try:
            status = run_generations(search, termination, callbacks)
        except KeyboardInterrupt:
            # keep what the finished generations found; the checkpoint allows --resume
            archiver.record(search)
            checkpointer.save(search)
            store.finish_run(run_id, {"generations": search.state.generation}, status="interrupted")
            raise
        entries = record_front(store, search, meta, final=True)
        if config.experiments and config.closed_loop_checks > 0:
            checked = closed_loop_check(
                entries, config.closed_loop_checks, Path(config.experiments), resolver, config.seed, config.jobs, ui
            )
            stats = {"evaluations": search.state.evaluations, "closed_loop_checked": [e.id for e in checked]}
            store.record_generation(run_id, search.state.generation, entries, best_entries(search, meta), stats)
        checkpointer.save(search)
        summary = {
            "generations": search.state.generation,
            "evaluations": search.state.evaluations,
            "unique_candidates": len(evaluator.memo),
            "wall_time_s": round(termination.elapsed_s(), 2),
            "front_size": len(entries),
            "status": status,
            "dataset_fingerprint": fingerprint,
            "primitives": names,
            "kv_sharing": ctx.steps.kv_sharing,
            "run_dir": str(root),
        }
        store.finish_run(run_id, summary, status="finished" if status == "finished" else "interrupted")
    ui.finish(entries, summary)
    return entries
