"""``run --load-draws N``: the replayed rows are the mean over N draws of each experiment's
load, and the final closed-loop check compares the mean of as many draws (near saturation
one draw's luck can move a mean TTFT by tens of percent)."""

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
from test_validate import LLAMA_7B, entry, observe, write_experiment

from fitness.replay_rows import ExperimentTrajectory, mean_of_draws, rows_from
from fitness.validate import ClosedLoopSettings
from primitives.deployment import default_resolver
from primitives.errors import InputError

LABELS = [("e2e", "all"), ("ttft", "all")]


def _draw(rng, steps: int, observed=(2.0e6, 1.0e5)) -> ExperimentTrajectory:
    return ExperimentTrajectory(
        name="exp",
        model="m",
        columns={"a": rng.random(steps), "b": rng.random(steps)},
        weights=rng.random((2, steps)),
        overhead=rng.random((2, 3)),
        fixed_us=rng.random(2),
        observed_us=np.asarray(observed),
        labels=LABELS,
        gain=np.ones(2),
        probes={"a": rng.random(4), "b": rng.random(4)},
    )


def _form(t: ExperimentTrajectory, coef: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """Each row's predicted mean for the step time ``coef @ (a, b)`` and non-step terms ``theta``."""
    step_us = coef[0] * t.columns["a"] + coef[1] * t.columns["b"]
    return t.weights @ step_us + t.overhead @ theta + t.fixed_us


def test_the_mean_of_draws_is_the_mean_of_their_linear_forms():
    rng = np.random.default_rng(0)
    draws = [_draw(rng, n) for n in (5, 7, 6)]  # draws of one load differ in their number of steps
    merged = mean_of_draws(draws)
    for _ in range(3):  # any candidate's step times and non-step terms
        coef, theta = rng.random(2) * 3, rng.random(3)
        want = np.mean([_form(d, coef, theta) for d in draws], axis=0)
        assert _form(merged, coef, theta) == pytest.approx(want, rel=1e-12)
    assert len(merged.columns["a"]) == 18 and len(merged.probes["b"]) == 12  # every draw's steps stay probes
    assert merged.labels == LABELS and merged.name == "exp"
    assert mean_of_draws(draws[:1]) is draws[0]  # one draw: its rows as they were
    rows = rows_from([merged])
    assert rows.names == ["exp"] and rows.weights[0].shape == (2, 18)


def test_the_seeds_of_a_setting_and_how_they_are_written():
    assert ClosedLoopSettings(3, 2).seeds == [3, 4] and ClosedLoopSettings(3, 2).seed_range == "3-4"
    assert ClosedLoopSettings(5, 0).seeds == [5] and ClosedLoopSettings(5, 0).seed_range == "5-5"


def test_a_row_that_one_draw_distrusts_is_dropped_and_other_experiments_are_refused():
    rng = np.random.default_rng(1)
    queued = _draw(rng, 4, observed=(np.nan, np.nan))  # this draw's recording queued where the server did not
    merged = mean_of_draws([_draw(rng, 4), queued])
    assert np.isnan(merged.observed_us).all()
    other = _draw(rng, 4)
    other.name = "another"
    with pytest.raises(ValueError, match="different experiments"):
        mean_of_draws([_draw(rng, 4), other])


def _row_means(rows, names, coef) -> np.ndarray:
    """The first experiment's replayed means for the step time ``coef @ names``."""
    step_us = sum(c * rows.columns[0][n] for c, n in zip(coef, names, strict=True))
    return rows.weights[0] @ step_us + rows.fixed_us[0]


def test_recordings_of_several_draws_are_the_mean_of_each_draws_recording(tmp_path, monkeypatch):
    from evolve.calibration import refresh_replay_rows

    monkeypatch.chdir(tmp_path)
    observe(write_experiment(tmp_path, "exp-a-llama-2-7b-tp1-general", *LLAMA_7B, stages=[(3.0, 6), (6.0, 6)]))
    resolver, names = default_resolver(), ["weight_time_us", "kv_io_time_us"]
    one = [refresh_replay_rows(tmp_path, resolver, entry(), names, ClosedLoopSettings(seed=s, jobs=1)) for s in (3, 4)]
    both = refresh_replay_rows(tmp_path, resolver, entry(), names, ClosedLoopSettings(3, 2, jobs=2))  # seeds 3, 4
    assert both.weights[0].shape[1] == sum(r.weights[0].shape[1] for r in one)
    for coef in ([1.3, 1.1], [2.0, 1.0]):
        singles = [_row_means(r, names, coef) for r in one]
        assert not np.allclose(*singles)  # the draws differ, so the mean means something
        assert _row_means(both, names, coef) == pytest.approx(np.mean(singles, axis=0), rel=1e-9)


def test_the_final_check_simulates_as_many_draws(tmp_path, monkeypatch):
    import evolve.validation as ev
    from evolve.calibration import refresh_replay_rows, scored_experiments

    monkeypatch.chdir(tmp_path)
    for workload in ("codegen", "general"):
        observe(write_experiment(tmp_path, f"e-llama-2-7b-tp1-{workload}", *LLAMA_7B, stages=[(2.0, 6), (4.0, 6)]))
    resolver = default_resolver()
    names = ["weight_time_us", "kv_io_time_us", "allreduce_calls"]
    rows = refresh_replay_rows(tmp_path, resolver, entry(), names, ClosedLoopSettings(jobs=1))
    seen = []
    real = ev.closed_loop_runs

    def spy(runs, resolver, settings, tails=True):
        seen.append((len(runs), settings.load_draws))
        return real(runs, resolver, settings, tails)

    monkeypatch.setattr(ev, "closed_loop_runs", spy)
    two = ClosedLoopSettings(load_draws=2, jobs=1)
    (checked,) = ev.closed_loop_check([entry()], 1, tmp_path, resolver, two, _Quiet(), rows, (1.0, 4.0))
    # the closed loop of both experiments, then each transfer check's held-out runs: two draws each
    assert seen[0] == (2, 2) and len(seen) > 1 and {d for _, d in seen} == {2}
    assert checked.objectives["closed_loop"] == 1.0 and "transfer_error" in checked.objectives
    item = checked.per_experiment[scored_experiments(tmp_path)[0].name]
    assert "e2e_error_closed_loop" in item


class _Quiet:
    def log(self, text: str) -> None:
        pass


def test_a_run_records_its_draws_and_an_old_run_resumes_with_one(tmp_path):
    from evolve.resume import _saved_config

    path = tmp_path / "run.json"
    base = {"generations": 5, "population": 10, "seed": 0}
    path.write_text(json.dumps(base))
    assert _saved_config(path).load_draws == 1
    path.write_text(json.dumps({**base, "load_draws": 3}))
    assert _saved_config(path).load_draws == 3
    for bad in (0, 1.5, "3", 101):
        path.write_text(json.dumps({**base, "load_draws": bad}))
        with pytest.raises(InputError, match="load_draws"):
            _saved_config(path)


def test_run_refuses_a_bad_number_of_draws_in_one_line(tmp_path, monkeypatch, capsys):
    from evolve.cli import main

    monkeypatch.chdir(tmp_path)
    for bad, expected in [("0", "1..100"), ("101", "1..100"), ("two", "a whole number")]:
        assert main(["run", "--generations", "1", "--load-draws", bad]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "--load-draws" in line and expected in line
    assert not (tmp_path / "runs").exists()


def test_every_recording_of_a_run_averages_the_runs_draws(monkeypatch):
    """Calibration (from scratch and from a checkpointed model) and the search's refreshes."""

    import evolve.calibration as cal
    from evolve.config import RunConfig
    from fitness.scoring import FitnessContext

    seen = []

    def spy(experiments_dir, resolver, entry, names, settings):
        seen.append((entry is None, settings.seed, settings.load_draws))
        return SimpleNamespace(tag=len(seen))

    monkeypatch.setattr(cal, "refresh_replay_rows", spy)
    scores = iter([SimpleNamespace(replay_error=0.2), SimpleNamespace(replay_error=0.1)])
    monkeypatch.setattr(cal, "best_seed", lambda ctx, names: (None, next(scores)))
    monkeypatch.setattr(cal, "replay_model_of", lambda score: ("1.0*tp", {}))
    config = RunConfig(generations=3, experiments="exps", seed=7, load_draws=3, calibration_rounds=1)
    ctx, ui = FitnessContext(None), _Quiet()
    cal.calibrated_replay_rows(config, None, ctx, ["tp"], None, ui)  # the reference, then the best seed
    cal.calibrated_replay_rows(config, None, ctx, ["tp"], ("2.0*tp", {}), ui)  # a resumed run's model
    search = SimpleNamespace(
        best_item=lambda: (None, "best"),
        state=SimpleNamespace(replay_model=None, generation=1),
        ctx=ctx,
        replace_context=lambda new: None,
    )
    cal.record_refresh(search, config, None, ["tp"], ui)
    assert seen == [(True, 7, 3), (False, 7, 3), (False, 7, 3), (False, 7, 3)]


def in_compiled_code(interrupt: BaseException, frames: int) -> SystemError:
    """INTERRUPT as numba delivers a signal handled inside compiled code: one SystemError
    ("returned a result with an exception set") per compiled frame, each chained to the last."""
    exc = interrupt
    for _ in range(frames):
        try:
            raise exc
        except BaseException as inner:
            try:
                raise SystemError("CPUDispatcher(<function f>) returned a result with an exception set") from inner
            except SystemError as outer:
                exc = outer
    return exc


def test_the_time_limit_is_found_behind_any_number_of_compiled_frames():
    from evolve.crash import TimeLimitReached, interrupt_behind, is_time_limit

    limit = TimeLimitReached("a trajectory refresh")
    for frames in (0, 1, 26):
        delivered = in_compiled_code(limit, frames)
        assert interrupt_behind(delivered) is limit and is_time_limit(delivered)
    ctrl_c = in_compiled_code(KeyboardInterrupt("signal 2"), 3)
    assert isinstance(interrupt_behind(ctrl_c), KeyboardInterrupt) and not is_time_limit(ctrl_c)
    assert interrupt_behind(in_compiled_code(ValueError("a real failure"), 3)) is None
    assert interrupt_behind(SystemError("a C extension failed")) is None
    try:  # a genuine failure while an interrupt is handled: the interrupt is its context, not its cause
        try:
            raise KeyboardInterrupt("signal 2")
        except KeyboardInterrupt:
            raise SystemError("a C extension failed") from None
    except SystemError as failed:
        assert interrupt_behind(failed) is None
    try:
        try:
            raise KeyboardInterrupt("signal 2")
        except KeyboardInterrupt:
            raise SystemError("a C extension failed")  # noqa: B904 (the implicit context is the case)
    except SystemError as failed:
        assert interrupt_behind(failed) is None


def test_the_time_limit_in_a_trajectory_refresh_stops_the_recording_and_leaves_the_search(monkeypatch):
    """The limit, delivered from compiled code, lands while the refresh records: the search
    keeps its trajectories and is never touched; without the limit the recording is adopted."""
    import evolve.run as er
    from evolve.config import RunConfig
    from evolve.crash import TimeLimitReached

    adopted, logged = [], []

    def recording_hit_by_the_limit(*args):
        raise in_compiled_code(TimeLimitReached("a trajectory refresh"), frames=26)

    monkeypatch.setattr(er, "record_refresh", recording_hit_by_the_limit)
    monkeypatch.setattr(er, "adopt_refresh", lambda search, rows, model: adopted.append(model))
    ui = SimpleNamespace(log=logged.append)
    refresh = er.TrajectoryRefresh(RunConfig(generations=9, refresh_every=3), None, ["tp"], ui, er.Termination(9, 60.0))
    search = SimpleNamespace(state=SimpleNamespace(generation=3))
    refresh.on_generation(search, 0.1)
    assert adopted == [] and logged == ["time limit reached while refreshing trajectories; keeping the previous ones"]
    monkeypatch.setattr(er, "record_refresh", lambda *args: ("rows", "model"))
    refresh.on_generation(search, 0.1)
    assert adopted == ["model"]


def test_a_finished_run_whose_final_check_the_time_limit_skipped_finishes_it_on_resume(tmp_path, monkeypatch):
    """A replay run with no more generations to go still owes its front the closed-loop
    check; once that is recorded, the same resume writes nothing."""
    import evolve.run as er
    from archive.rundir import RunDir
    from evolve.config import RunConfig
    from evolve.crash import TimeLimitReached
    from evolve.ui import RunUI

    monkeypatch.chdir(tmp_path)
    exps = tmp_path / "exps"
    observe(write_experiment(exps, "e-llama-2-7b-tp1-general", *LLAMA_7B, rate=2.0, duration=6))
    calls = []
    real = er.closed_loop_check

    def check(*args, **kwargs):
        calls.append(len(calls))
        if len(calls) == 1:  # the time limit lands in the first run's final check, inside compiled code
            raise in_compiled_code(TimeLimitReached("the final closed-loop check"), frames=26)
        return real(*args, **kwargs)

    monkeypatch.setattr(er, "closed_loop_check", check)
    options = dict(generations=2, population=12, experiments=str(exps), closed_loop_checks=1, calibration_rounds=0)
    er.run_search(RunConfig(run_dir="runs/a", **options), RunUI(quiet=True, stream=io.StringIO()))
    archive = RunDir(tmp_path / "runs" / "a").archive

    def checked_generations() -> list:
        from archive.store import ArchiveStore

        with ArchiveStore(archive, create=False, read_only=True) as store:
            (run,) = store.runs()
            return [h["stats"].get("closed_loop_checked") for h in store.history(run.run_id)]

    assert calls == [0] and not any(checked_generations())
    resume = RunConfig(resume="runs/a", **options)
    er.run_search(resume, RunUI(quiet=True, stream=io.StringIO()), given=frozenset({"generations"}))
    assert calls == [0, 1] and checked_generations()[-1]  # the check ran, and is recorded
    before = archive.read_bytes()
    er.run_search(resume, RunUI(quiet=True, stream=io.StringIO()), given=frozenset({"generations"}))
    assert calls == [0, 1] and archive.read_bytes() == before  # nothing left to do: nothing written


def test_ctrl_c_in_the_final_check_keeps_the_run_at_its_generation(tmp_path, monkeypatch):
    """An interrupt in the final closed-loop check marked the run interrupted at generation 0
    and left the checkpoint where the last periodic save put it."""
    import evolve.run as er
    from archive.rundir import RunDir
    from archive.store import ArchiveStore
    from evolve.config import RunConfig
    from evolve.search import Search
    from evolve.ui import RunUI

    monkeypatch.chdir(tmp_path)
    exps = tmp_path / "exps"
    observe(write_experiment(exps, "e-llama-2-7b-tp1-general", *LLAMA_7B, rate=2.0, duration=6))

    def check(*args, **kwargs):
        raise in_compiled_code(KeyboardInterrupt("signal 2"), frames=3)

    monkeypatch.setattr(er, "closed_loop_check", check)
    options = dict(generations=2, population=12, experiments=str(exps), closed_loop_checks=1, calibration_rounds=0)
    config = RunConfig(run_dir="runs/a", checkpoint_every=5, **options)
    with pytest.raises(KeyboardInterrupt):
        er.run_search(config, RunUI(quiet=True, stream=io.StringIO()))
    run_dir = RunDir(tmp_path / "runs" / "a")
    with ArchiveStore(run_dir.archive, create=False, read_only=True) as store:
        (run,) = store.runs()
        assert run.status == "interrupted" and run.summary["generations"] == 2 and store.front()
    assert Search.peek_checkpoint(run_dir.checkpoint).generation == 2
