"""Which run a ``python -m evolve run`` is: a new one in an unused directory, or ``--resume``
of the run a directory holds, with that run's own configuration.

A resumed run may change only how long it goes on and how it computes (``--generations``,
not below the checkpoint's, ``--time-limit``, ``--jobs``, ``--backend``, ``--scheduler``); any other option
given must agree with ``run.json``, or the run is refused (it would otherwise mix two
searches in one archive).
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

from archive.rundir import RunDir, default_run_dir, refuse_used_dir
from evolve.config import MAX_LOAD_DRAWS, RunConfig, bounds_problem, current_environment, environment_changes
from fitness.step_scatter import StepScatter
from primitives import checks
from primitives.errors import InputError
from primitives.files import read_mapping

MAX_SEED = 2**63 - 1  # sqlite's INTEGER
# options a resumed run takes from run.json: RunConfig field -> its flag
FIXED_BY_THE_RUN = {
    "population": "--population",
    "seed": "--seed",
    "data": "--data",
    "experiments": "--experiments",
    "model_configs": "--model-configs",
    "gpu_datasheet": "--gpu-datasheet",
    "kernels": "--kernels",
    "efficiency_bounds": "--efficiency-bounds",
    "scatter_steps": "--step-scatter",
    "load_draws": "--load-draws",
    "checkpoint_every": "--checkpoint-every",
}
PATH_FIELDS = ("experiments", "model_configs", "gpu_datasheet", "kernels")


def _absolute(config: RunConfig) -> RunConfig:
    """Paths as absolute ones: run.json must work from any directory, for --resume."""
    config.data = [str(Path(p).resolve()) for p in config.data]
    for name in PATH_FIELDS:
        if getattr(config, name):
            setattr(config, name, str(Path(getattr(config, name)).resolve()))
    return config


def fresh_config(config: RunConfig) -> RunConfig:
    """A new run: absolute paths, its own token, an unused directory (refused now, before any work)."""
    config = _absolute(config)
    config.run_token = uuid.uuid4().hex
    config.environment = current_environment()
    root = Path(config.run_dir) if config.run_dir else default_run_dir(config.seed)
    refuse_used_dir(root)
    config.run_dir = str(root)
    return config


def _plain(value):
    """What to compare: lists and tuples alike (run.json holds lists), numbers as floats."""
    return (
        [float(v) if isinstance(v, (int, float)) else v for v in value] if isinstance(value, (list, tuple)) else value
    )


def _saved_config(path: Path) -> RunConfig:
    saved = read_mapping(path, "json")  # anything but a JSON object is refused there
    for name in ("generations", "population", "seed"):
        if name not in saved:
            raise InputError(path, name, "a required field is missing; not a run.json of this program")
        checks.number(saved[name], path, name, integer=True, allow_zero=name == "seed", upper=MAX_SEED)
    if not isinstance(saved.get("data", []), list):
        raise InputError(path, "data", f"expected a list of paths, got {saved['data']!r}")
    for key in ("efficiency_caps", "efficiency_floors"):  # a run from before them resumes without them
        bounds = saved.setdefault(key, {})
        if not isinstance(bounds, dict):
            raise InputError(path, key, f"expected a mapping of primitive to a number, got {bounds!r}")
        from primitives.registry import PRIMITIVE_BY_NAME  # sympy: on a resume, not at the CLI's start-up

        for name, bound in bounds.items():
            if getattr(PRIMITIVE_BY_NAME.get(name), "unit", None) != "us":
                raise InputError(path, f"{key}.{name}", "expected the name of a µs primitive")
            checks.number(bound, path, f"{key}.{name}")
    _check_search_fields(saved, path)
    saved.setdefault("scatter_steps", False)  # a run from before the step scatter resumes without it
    checks.boolean(saved["scatter_steps"], path, "scatter_steps")
    if saved.get("step_scatter") is not None:
        StepScatter.from_dict(saved["step_scatter"], path)
    env = saved.get("environment")  # a run from before it recorded none
    if env is not None and not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
        raise InputError(path, "environment", f"expected a mapping of names to version strings, got {env!r}")
    saved.setdefault("load_draws", 1)  # a run from before the draws resumes with one
    checks.number(saved["load_draws"], path, "load_draws", integer=True, upper=MAX_LOAD_DRAWS)
    return RunConfig.from_dict(saved)


def _check_search_fields(saved: dict, path: Path) -> None:
    """The fields a resumed search reads, held to what the command line or the defaults
    would have given (a damaged run.json must not start a search that scores nothing)."""
    for name, least, most in (("max_depth", 1, 64), ("max_size", 1, 10_000), ("checkpoint_every", 1, None)):
        if name in saved:
            value = checks.number(saved[name], path, name, integer=True, upper=most)
            if value < least:
                raise InputError(path, name, f"expected at least {least}, got {value!r}")
    for name in ("calibration_rounds", "refresh_every", "closed_loop_checks"):
        if name in saved:
            checks.number(saved[name], path, name, integer=True, allow_zero=True, upper=10**6)
    if "replay_weight" in saved:
        checks.number(saved["replay_weight"], path, "replay_weight", allow_zero=True, upper=1e6)
    if "validation_fraction" in saved:
        fraction = checks.number(saved["validation_fraction"], path, "validation_fraction", allow_zero=True)
        if fraction >= 1:
            raise InputError(path, "validation_fraction", f"expected a fraction in [0, 1), got {fraction!r}")
    inputs = [(f"data[{i}]", d) for i, d in enumerate(saved.get("data", []))]
    for name, value in inputs + [(n, saved.get(n)) for n in PATH_FIELDS]:
        if value is not None and not Path(checks.text(value, path, name, "a path")).exists():
            raise InputError(path, name, f"{value} is gone; restore it there to resume this run")  # inputs moved
    caps, floors = saved.get("efficiency_caps", {}), saved.get("efficiency_floors", {})
    for name in caps.keys() & floors.keys():
        if floors[name] > caps[name]:  # both are measured from one kernel table: never so
            raise InputError(path, f"efficiency_floors.{name}", f"{floors[name]} is above its cap {caps[name]}")
    if "efficiency_bounds" in saved:
        bounds = saved["efficiency_bounds"]
        if not (isinstance(bounds, list) and len(bounds) == 2):
            raise InputError(path, "efficiency_bounds", f"expected [LO, HI], got {bounds!r}")
        problem = bounds_problem(*(checks.number(b, path, "efficiency_bounds") for b in bounds))
        if problem:
            raise InputError(path, "efficiency_bounds", f"{problem}, got {bounds!r}")


def resumed_config(config: RunConfig, given: set[str]) -> RunConfig:
    """The configuration of the run in ``config.resume``; GIVEN: the RunConfig fields set on the
    command line, each of which must agree with it."""
    root = Path(config.resume)
    saved = RunDir(root).run_config
    if not saved.is_file():
        what = f"{saved.name} is not a file" if saved.exists() else f"no {saved.name}"
        raise InputError(root, "--resume", f"not a run directory ({what})")
    old = _saved_config(saved)
    if config.run_dir and Path(config.run_dir).resolve() != root.resolve():
        raise InputError("--run-dir", None, f"contradicts --resume {root}; give only --resume")
    mine = _absolute(config)
    for name in sorted(given & set(FIXED_BY_THE_RUN)):
        ours, theirs = _plain(getattr(mine, name)), _plain(getattr(old, name))
        if ours != theirs:
            raise InputError(
                FIXED_BY_THE_RUN[name],
                None,
                f"the run in {root} was made with {theirs!r}, not {ours!r}; drop the flag to resume it, "
                "or start a new run",
            )
    changes = environment_changes(old.environment, current_environment())
    if changes:  # allowed, but the resumed generations may take another path than on the run's own machine
        print(
            f"warning: {root} was made elsewhere ({'; '.join(changes)}); its search may go on differently",
            file=sys.stderr,
        )
    old.resume = old.run_dir = str(root)
    old.generations = config.generations
    old.jobs, old.backend, old.scheduler = config.jobs, config.backend, config.scheduler
    old.time_limit_s = config.time_limit_s
    return old
