"""The configuration of one search run (what `python -m evolve run` was asked to do)."""

from __future__ import annotations

import platform
from argparse import ArgumentTypeError
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path


@dataclass
class RunConfig:
    generations: int = 200
    population: int = 200
    data: list[str] = field(default_factory=list)  # step trace files/dirs; empty = embedded default
    experiments: str | None = None  # experiment directories for replayed E2E objectives
    seed: int = 0
    jobs: int = 1
    run_dir: str | None = None
    time_limit_s: float | None = None
    model_configs: str | None = None  # folder of HF config.json folders; None = built-ins
    gpu_datasheet: str | None = None
    kernels: str | None = None  # folder of the GPU's measured kernel tables; None = built-in
    validation_fraction: float = 0.2  # temporal holdout per experiment
    max_depth: int = 8
    max_size: int = 40
    checkpoint_every: int = 5
    backend: str = "loky"  # or "dask"
    scheduler: str | None = None  # dask scheduler address
    resume: str | None = None
    run_token: str | None = None  # the run's identity: run.json and its checkpoint carry it
    replay_weight: float = 1.0  # one replayed metric row against one experiment's step rows
    calibration_rounds: int = 1  # closed-loop refits of the reference trajectories before the search
    refresh_every: int = 0  # generations between trajectory refreshes; 0 = a third of the run
    efficiency_bounds: list[float] = field(default_factory=lambda: [1.0, 4.0])  # a µs term's coefficient
    # caps of measured-kernel-priced terms (fitness.efficiency); None: from the GPU's kernels at the start
    efficiency_caps: dict[str, float] | None = None
    efficiency_floors: dict[str, float] | None = None  # lower bounds of the same, likewise
    closed_loop_checks: int = 32  # front entries validated in the closed loop at the end of a replay run
    # simulated steps scatter as the run's step data do (fitness.step_scatter), measured at the start
    scatter_steps: bool = False
    step_scatter: dict | None = None  # StepScatter.to_dict() of the measured scatter; None: none
    # draws of each experiment's load the replayed rows and the final closed-loop check average
    load_draws: int = 1
    # where the run was made (current_environment): the same seed and data give the same archive
    # on the same CPU and packages; floating-point sums differ in their last bits elsewhere
    environment: dict[str, str] | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


# the packages whose arithmetic a run's numbers pass through
NUMERIC_PACKAGES = ("numpy", "scipy", "numba", "llvmlite", "sympy", "deap", "pandas", "pyarrow")


def _cpu_model() -> str:
    try:  # Linux names the model here; platform.processor() is often empty there
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def current_environment() -> dict[str, str]:
    """The Python, CPU and numeric packages this process runs on (recorded in run.json)."""
    env = {"python": platform.python_version(), "machine": platform.machine(), "cpu": _cpu_model()}
    for name in NUMERIC_PACKAGES:
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = "absent"
    return env


def environment_changes(recorded: dict[str, str] | None, now: dict[str, str]) -> list[str]:
    """``numpy 2.3.1 -> 2.4.6``, one per item that differs (none for a run that recorded nothing)."""
    if not recorded:
        return []
    return [f"{k} {recorded.get(k, '?')} -> {v}" for k, v in now.items() if recorded.get(k) != v]


MAX_LOAD_DRAWS = 100  # draws of an experiment's load a run or a validation may average
REFIT_ROUNDS = 2  # validate's transfer checks: re-recordings of each fold's training runs (evolve.validation)

BOUNDS_HELP = "interval of a µs term's fitted efficiency (default 1,4)"


def bounds_problem(lo: float, hi: float) -> str | None:
    """What is wrong with an efficiency interval [LO, HI] (None if nothing): the one rule for
    the command line's ``--efficiency-bounds`` and a resumed run's ``run.json``."""
    return None if 0 < lo <= hi < float("inf") else "expected 0 < LO <= HI, finite"


def parse_bounds(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise ArgumentTypeError(f"expected LO,HI (two numbers), got {text!r}") from None
    problem = bounds_problem(lo, hi)
    if problem:
        raise ArgumentTypeError(f"{problem}, got {text!r}")
    return lo, hi
