"""`python -m evolve run`: load data, search, archive the front every few generations.

The run is put together the way pymoo separates problem, algorithm, termination and
callbacks: the fitness context is the problem, ``Search`` the algorithm, a
``Termination`` says when to stop (generations, time limit), and callbacks act after
every generation, in order: trajectory refresh, progress, archiving, checkpointing.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, NamedTuple, NoReturn

from archive.rundir import RunDir, RunLock, check_latest_writable, record_latest, refuse_used_dir
from archive.store import ArchiveStore
from evolve.calibration import (
    adopt_refresh,
    calibrated_replay_rows,
    experiments_fingerprint,
    record_refresh,
    refresh_every,
    run_settings,
)
from evolve.config import RunConfig
from evolve.crash import OutputClosed, interrupt_behind, is_time_limit, time_limit_alarm
from evolve.evaluator import Evaluator
from evolve.records import best_entries, record_front
from evolve.resume import fresh_config, resumed_config
from evolve.search import Search
from evolve.validation import closed_loop_check
from fitness.dataset import build_step_table
from fitness.efficiency import as_bounds
from fitness.kv_sharing import trace_kv_sharing
from fitness.physics_probes import PhysicsProbes
from fitness.scoring import FitnessContext
from fitness.sim.loadgen import check_servable
from fitness.step_scatter import describe_scatter, measure_scatter, recorded_scatter
from primitives.data.experiments import find_experiments
from primitives.data.roots import default_data_dir
from primitives.data.traces import load_steps
from primitives.deployment import DeploymentResolver
from primitives.errors import InputError
from primitives.files import atomic_write_json, writable_dir
from primitives.kernels import efficiency_caps, efficiency_floors
from primitives.registry import supported_primitives


# -- termination and callbacks ------------------------------------------------------------
class RunEnd(NamedTuple):
    """How a run that returned ended: its front, and its status ("finished", "time-limit")."""

    front: list
    status: str


@dataclass
class Termination:
    """When the run stops: after ``generations``, or once ``time_limit_s`` has passed since it started."""

    generations: int
    time_limit_s: float | None = None
    started_at: float = field(default_factory=time.perf_counter)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started_at

    def remaining_s(self) -> float | None:
        return None if self.time_limit_s is None else self.time_limit_s - self.elapsed_s()

    def out_of_time(self) -> bool:
        return self.time_limit_s is not None and self.elapsed_s() >= self.time_limit_s

    def reason(self, generation: int) -> str | None:
        """Why the run stops before the next generation ("finished", "time-limit"), or None to go on."""
        if generation >= self.generations:
            return "finished"
        if self.out_of_time():
            return "time-limit"
        return None


class TrajectoryRefresh:
    """Every few generations (never after the last), re-record the replay trajectories with the best model."""

    def __init__(self, config: RunConfig, resolver: DeploymentResolver, names: list[str], ui, termination):
        self.config, self.resolver, self.names, self.ui = config, resolver, names, ui
        self.termination = termination

    def on_generation(self, search: Search, step_s: float) -> None:
        generation = search.state.generation
        due = generation % refresh_every(self.config) == 0 and generation < self.config.generations
        if due and not self.termination.out_of_time():
            try:  # the limit stops the recording only: the search is untouched until the swap
                with time_limit_alarm(self.termination.remaining_s(), "a trajectory refresh"):
                    recorded = record_refresh(search, self.config, self.resolver, self.names, self.ui)
            except BaseException as exc:  # the limit: keep the current trajectories, stop next
                if not is_time_limit(exc):
                    raise
                self.ui.log("time limit reached while refreshing trajectories; keeping the previous ones")
                return
            if recorded is not None:
                adopt_refresh(search, *recorded)


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

    def __init__(self, path: Path, every: int, owner: dict):
        self.path, self.every, self.owner = path, max(every, 1), owner

    def save(self, search: Search) -> None:
        search.save_checkpoint(self.path, self.owner)

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
def prepare_context(config: RunConfig, resolver: DeploymentResolver, log: Callable[[str], None] | None = None):
    """Data -> primitive columns -> the fitness context (replay rows come separately). LOG
    (a resumed run): told where the run's recorded bounds differ from today's code's."""
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
    gpus = list({d.gpu.name: d.gpu for d in deployments}.values())
    caps, floors = efficiency_caps(gpus), efficiency_floors(gpus)
    if config.efficiency_caps is None:  # a resumed run keeps the caps it started with
        config.efficiency_caps = caps
    if config.efficiency_floors is None:  # likewise the floors
        config.efficiency_floors = floors
    changed = [k for k in caps if config.efficiency_caps.get(k) != caps[k]]
    changed += [k for k in floors if config.efficiency_floors.get(k) != floors[k]]
    if changed and log:  # same seed, same archive: the run keeps its own, but says so
        log(f"kept the run's own efficiency bounds; today's differ on {', '.join(sorted(set(changed)))}")
    if config.scatter_steps and config.step_scatter is None:  # a resumed run keeps the scatter it measured
        source = ", ".join(paths) if config.data else "the embedded default data"
        try:
            config.step_scatter = measure_scatter(table, source).to_dict()
        except InputError:  # too few steps to tell scatter from a changing batch: none
            config.step_scatter = None
    ctx = FitnessContext(
        table,
        None,
        config.replay_weight,
        efficiency_bounds=as_bounds(config.efficiency_bounds, config.efficiency_caps, config.efficiency_floors),
        # every deployment the export ships: data from two of them cannot tell weight streaming
        # from a constant, the other deployments' kernels can
        probes=PhysicsProbes.build(resolver.with_catalog(deployments), names, config.efficiency_bounds[0]),
    )
    return ctx, names, data


def run_search(config: RunConfig, ui, given: frozenset[str] = frozenset(), started_at: float | None = None) -> RunEnd:
    """The whole run. GIVEN: RunConfig fields set on the command line (a resume checks them);
    STARTED_AT: when the command started (``--time-limit`` bounds all of it).

    Nothing is written before the inputs have loaded and the replay rows are recorded; a
    refused run leaves the directory (run.json, checkpoint) and ``runs/LATEST`` as they
    were, a crashed one is marked ``failed`` in the archive, and LATEST moves only to a
    run that finished or was interrupted.
    """
    termination = Termination(config.generations, config.time_limit_s, started_at or time.perf_counter())
    config = resumed_config(config, set(given)) if config.resume else fresh_config(config)
    check_latest_writable()  # not only at the end of the search
    with time_limit_alarm(termination.remaining_s(), "set-up (loading the inputs, recording trajectories)"):
        return _run(config, ui, termination)


def _run(config: RunConfig, ui, termination: Termination) -> RunEnd:
    root = Path(config.run_dir)
    resolver = DeploymentResolver.from_options(
        *(Path(v) if v else None for v in (config.model_configs, config.gpu_datasheet, config.kernels))
    )
    ctx, names, data = prepare_context(config, resolver, ui.log)
    if config.scatter_steps:
        scatter = recorded_scatter(config.step_scatter)
        ui.log(describe_scatter(scatter.summary()) if scatter else "too few steps to measure their scatter: none")
    if config.experiments and config.load_draws > 1:
        seeds = run_settings(config).seed_range
        ui.log(f"replayed means: the mean of {config.load_draws} draws of each load (seeds {seeds})")
    fingerprint = ctx.steps.fingerprint
    if config.experiments:
        fingerprint = f"{fingerprint}+{experiments_fingerprint(Path(config.experiments))}"
    owner = {"run_token": config.run_token, "fingerprint": fingerprint}
    run_dir = RunDir(root)
    saved = resumed = None
    if config.resume:  # verified before any work: never a silent restart from generation 0
        if not run_dir.checkpoint.is_file():
            raise InputError(run_dir.checkpoint, "--resume", "no checkpoint to resume from; start a new run instead")
        if not run_dir.archive.is_file():  # a new archive would lose the run's history unnoticed
            raise InputError(
                run_dir.archive, "--resume", "the run's archive is missing; restore it, or start a new run instead"
            )
        with ArchiveStore(run_dir.archive, create=False, read_only=True) as store:
            saved = Search.peek_checkpoint(run_dir.checkpoint, owner)  # run.json's run, and its data
            resumed = store.resumable_run(config.run_token)  # whole; its run keeps its id in a renamed directory
            if config.generations < saved.generation:
                raise InputError(
                    "--generations", None, f"the run in {root} is at generation {saved.generation}; give at least that"
                )
            # nothing to re-record, unless a replay run's final closed-loop check was skipped (time limit)
            if resumed.status == "finished" and config.generations == saved.generation:
                last = store.history(resumed.run_id)[-1:]
                if not (config.experiments and config.closed_loop_checks) or any(
                    "closed_loop_checked" in h["stats"] for h in last
                ):
                    record_latest(root)  # `archive best` then shows this run
                    try:
                        ui.log(f"finished at generation {saved.generation}; give more --generations to go on")
                    except OutputClosed:  # the UI has silenced its output already
                        raise OutputClosed(finished_in=root) from None
                    return RunEnd(store.front(resumed.run_id), "finished")  # the run's lines: the caller
    replay_model = None
    if config.experiments:
        rows, replay_model = calibrated_replay_rows(
            config, resolver, ctx, names, saved.replay_model if saved else None, ui
        )
        ctx = replace(ctx, replay=rows)
    termination.generations = config.generations

    signal.setitimer(signal.ITIMER_REAL, 0)  # set-up is over: from here Termination decides
    root = writable_dir(root, "--resume" if config.resume else "--run-dir")
    run_id = resumed.run_id if config.resume else root.name
    meta = {"run_id": run_id, "fingerprint": fingerprint, "seed": config.seed, "config": config.to_dict()}
    # the lock, then the pool (or the Dask connection): a bad --scheduler leaves no half-started run
    with RunLock(root), Evaluator(ctx, config.jobs, config.backend, config.scheduler) as evaluator:
        run_dir.remove_stale_temporaries()  # of a writer killed in an earlier life of the run
        if not config.resume:
            refuse_used_dir(root)  # again, under the lock: a run that started meanwhile owns it
            atomic_write_json(run_dir.run_config, config.to_dict(), indent=2, sort_keys=True)
        try:
            with ArchiveStore(run_dir.archive) as store:
                store.start_run(run_id, config.to_dict(), config.seed, fingerprint)
                try:
                    entries, summary = _search(
                        config, ctx, names, resolver, replay_model, evaluator, store, meta, termination, owner, ui
                    )
                except BaseException as exc:
                    interrupt = interrupt_behind(exc)
                    if interrupt is None:
                        store.finish_run(run_id, {"error": f"{type(exc).__name__}: {exc}"[:500]}, status="failed")
                        raise
                    if not config.resume and not run_dir.checkpoint.is_file():
                        raise  # no generation finished: the directory goes back to unused, below
                    if next(r.status for r in store.runs() if r.run_id == run_id) == "running":  # before the loop
                        store.finish_run(run_id, {"generations": 0}, status="interrupted")
                    record_latest(root)  # the finished generations are kept, and resumable
                    if interrupt is exc:
                        raise
                    raise interrupt from None
                summary.update(dataset_fingerprint=fingerprint, kv_sharing=ctx.steps.kv_sharing, run_dir=str(root))
                status = "finished" if summary["status"] == "finished" else "interrupted"
                store.finish_run(run_id, summary, status=status)
                record_latest(root)
        except BaseException as exc:
            interrupt = interrupt_behind(exc)
            if interrupt is not None and not config.resume and not run_dir.checkpoint.is_file():
                run_dir.forget_unstarted()  # nothing to resume: a rerun may use the directory
                if interrupt is not exc:
                    raise interrupt from None
            raise
    try:
        ui.finish(entries, summary)
    except OutputClosed:  # the run is recorded: a finished one has nothing to resume (the UI silenced its output)
        raise OutputClosed(finished_in=root if summary["status"] == "finished" else None) from None
    return RunEnd(entries, summary["status"])


def _stop(exc: BaseException, search, store, run_id: str, checkpointer, archiver=None) -> NoReturn:
    """Raise EXC on. An interrupt first keeps what the finished generations found (the front
    with ARCHIVER, a checkpoint for --resume) and marks the run interrupted at its generation."""
    interrupt = interrupt_behind(exc)
    if interrupt is None:
        raise exc
    if archiver is not None:
        archiver.record(search)
    checkpointer.save(search)
    store.finish_run(run_id, {"generations": search.state.generation}, status="interrupted")
    if interrupt is exc:
        raise exc
    raise interrupt from None


def _search(
    config, ctx, names, resolver, replay_model, evaluator, store, meta, termination, owner, ui
) -> tuple[list, dict]:
    """Initialise or load the search, run its generations, archive the front; (entries, summary)."""
    run_dir, run_id = RunDir(Path(config.run_dir)), meta["run_id"]
    search = Search(config, ctx, names, evaluator)
    if config.resume:
        search.load_checkpoint(run_dir.checkpoint, owner)
        ui.log(f"resumed {run_dir.root} at generation {search.state.generation}")
    else:
        search.initialise()
        search.state.replay_model = replay_model
        search.save_checkpoint(run_dir.checkpoint, owner)
    ui.start(config.generations, config.time_limit_s)
    archiver = Archiver(store, meta, config.checkpoint_every)
    checkpointer = Checkpointer(run_dir.checkpoint, config.checkpoint_every, owner)
    callbacks = [Progress(ui, search), archiver, checkpointer]
    if config.experiments:
        callbacks.insert(0, TrajectoryRefresh(config, resolver, names, ui, termination))
    try:
        status = run_generations(search, termination, callbacks)
    except BaseException as exc:
        _stop(exc, search, store, run_id, checkpointer, archiver)
    entries = record_front(store, search, meta, final=True)
    if config.experiments and config.closed_loop_checks > 0 and not termination.out_of_time():
        try:
            with time_limit_alarm(termination.remaining_s(), "the final closed-loop check"):
                checked = closed_loop_check(
                    entries,
                    config.closed_loop_checks,
                    Path(config.experiments),
                    resolver,
                    run_settings(config),
                    ui,
                    rows=search.ctx.replay,
                    bounds=search.ctx.efficiency_bounds,
                )
        except BaseException as exc:  # the limit: the front stays as the search scored it
            if not is_time_limit(exc):
                _stop(exc, search, store, run_id, checkpointer)  # the final front is recorded already
            ui.log("time limit reached during the final closed-loop check; the front keeps the search's scores")
        else:
            stats = {"evaluations": search.state.evaluations, "closed_loop_checked": [e.id for e in checked]}
            store.record_generation(run_id, search.state.generation, entries, best_entries(search, meta), stats)
    elif config.experiments and config.closed_loop_checks > 0:
        ui.log("time limit reached: the closed-loop check of the front is skipped")
    checkpointer.save(search)
    summary = {
        "generations": search.state.generation,
        "evaluations": search.state.evaluations,
        "unique_candidates": len(evaluator.seen),  # in this process (a resumed run counts anew)
        "wall_time_s": round(termination.elapsed_s(), 2),
        "front_size": len(entries),
        "status": status,
        "primitives": names,
    }
    return entries, summary
