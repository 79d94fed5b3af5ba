"""Experiment directories of the real study: what ran, and what the client measured.

An experiment directory holds

* ``exp-config.yaml``: the vLLM server settings (model, tensor parallelism, limits);
* ``profile.yaml``: the load generator's input (one line of JSON);
* ``results/config.yaml``: the load generator's *resolved* configuration, i.e. what
  actually ran (it wins over ``profile.yaml``: e.g. ``num_groups: 10`` where the profile
  asks for 9 system prompts);
* ``results/summary_lifecycle_metrics.json`` and ``results/stage_<N>_lifecycle_metrics.json``:
  the client-side latencies (seconds). The reasoning runs have none (blind test).

Every malformed input raises :class:`primitives.errors.InputError` naming the file,
the field and what was expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primitives import checks
from primitives.deployment import DEFAULT_GPU_MEMORY_UTILIZATION
from primitives.distribution import PERCENTILES, stat_key
from primitives.errors import InputError
from primitives.files import read_mapping

# aiohttp's default total timeout (ClientTimeout(total=300)), which inference-perf keeps
# when ``load.request_timeout`` is null.
DEFAULT_REQUEST_TIMEOUT_S = 300.0
# The vLLM server limits of every run in the data (exp-config.yaml): an ExperimentSpec's
# defaults, the emulator's runs and the Go export's golden batches.
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_STAGE_INTERVAL_S = 1.0  # inference-perf's ``load.interval``: pause between stages
SIMULATED_LOAD_TYPES = ("constant",)  # inference-perf's load timers that fitness.sim.loadgen reproduces

EXP_CONFIG = "exp-config.yaml"
PROFILE = "profile.yaml"
RESULTS_CONFIG = "results/config.yaml"
SUMMARY_METRICS = "results/summary_lifecycle_metrics.json"
_STAGE_RE = re.compile(r"^stage_(\d+)_lifecycle_metrics\.json$")
# Each latency's block under ``successes.latency`` in the lifecycle files.
LATENCY_FILE_KEYS = {
    "e2e": "request_latency",
    "ttft": "time_to_first_token",
    "itl": "inter_token_latency",
    "tpot": "time_per_output_token",
}


@dataclass(frozen=True)
class LifecycleMetrics:
    """Client-side request metrics of a run or a stage (seconds, over successes).

    ``distributions``: per latency (``e2e``, ``ttft``, ``itl``, ``tpot``) its percentiles by
    key (``p0.1`` ... ``p99.9``, ``primitives.distribution``), where known. It stays out of
    the repr and of comparisons, so fingerprints made from the means do not change.
    """

    successes: int
    failures: int
    e2e_mean_s: float | None = None
    ttft_mean_s: float | None = None
    itl_mean_s: float | None = None
    tpot_mean_s: float | None = None
    distributions: dict[str, dict[str, float]] = field(default_factory=dict, repr=False, compare=False)

    def stat_s(self, metric: str, stat: str) -> float | None:
        """``mean`` or a percentile key (``p90``) of METRIC, in seconds; None when unknown."""
        if stat == "mean":
            return getattr(self, f"{metric}_mean_s")
        return self.distributions.get(metric, {}).get(stat)

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "successes": self.successes,
            "failures": self.failures,
            "e2e_mean_s": self.e2e_mean_s,
            "ttft_mean_s": self.ttft_mean_s,
            "itl_mean_s": self.itl_mean_s,
            "tpot_mean_s": self.tpot_mean_s,
        }


@dataclass(frozen=True)
class ObservedMetrics:
    """The summary over the whole run and one entry per load stage (same keys)."""

    summary: LifecycleMetrics
    stages: tuple[LifecycleMetrics, ...] = ()


@dataclass(frozen=True)
class ExperimentSpec:
    """Everything the closed-loop simulation needs about one run, plus what was observed."""

    name: str
    model: str  # HF id, e.g. "meta-llama/Llama-2-70b-hf"
    tp: int
    stages: tuple[tuple[float, float], ...]  # (rate req/s, duration s)
    num_groups: int
    num_prompts_per_group: int
    system_prompt_len: int  # configured tokens (before re-tokenisation)
    question_len: int
    output_len: int
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    stage_interval_s: float = DEFAULT_STAGE_INTERVAL_S
    load_type: str = "constant"
    observed: ObservedMetrics | None = None
    path: str | None = None

    @property
    def num_users(self) -> int:
        return self.num_groups * self.num_prompts_per_group

    @property
    def num_requests(self) -> int:
        return sum(int(rate * duration) for rate, duration in self.stages)

    @property
    def workload(self) -> str:
        return workload_of(self.name)


def workload_of(experiment_name: str) -> str:
    """The workload name at the end of an experiment's directory name (general, codegen, ...)."""
    return experiment_name.rsplit("-", 1)[-1]


# ---------------------------------------------------------------------------
# Field access with precise errors


_MISSING = object()


def _get(data: dict, dotted: str, path: Path, default: Any = _MISSING) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            if default is not _MISSING:
                return default
            raise InputError(path, dotted, "a required field is missing")
        node = node[part]
    if node is None and default is not _MISSING:
        return default
    return node


def _number(value: Any, path: Path, dotted: str, **bounds: Any) -> float | int:
    # YAML may hold numbers as strings ("600"): accepted when they parse
    return checks.number(value, path, dotted, text_ok=True, **bounds)


def _num_field(data: dict, dotted: str, path: Path, *, default: Any = _MISSING, **bounds: Any) -> float | int:
    """The number at DOTTED; BOUNDS: ``checks.number``'s (integer, allow_zero, upper)."""
    return _number(_get(data, dotted, path, default), path, dotted, **bounds)


# ---------------------------------------------------------------------------
# Parsing the three inputs


def _parse_stages(load: Any, path: Path, prefix: str) -> tuple[tuple[float, float], ...]:
    stages = _get({"load": load}, "load.stages", path) if isinstance(load, dict) else None
    if not isinstance(stages, list) or not stages:
        raise InputError(path, f"{prefix}.stages", "expected a non-empty list of {rate, duration} stages")
    out = []
    for i, st in enumerate(stages):
        where = f"{prefix}.stages[{i}]"
        if not isinstance(st, dict):
            raise InputError(path, where, "expected a mapping with rate and duration")
        if "rate" not in st or st["rate"] is None:
            raise InputError(path, f"{where}.rate", "a required field is missing (requests per second)")
        if "duration" not in st or st["duration"] is None:
            raise InputError(path, f"{where}.duration", "a required field is missing (seconds)")
        rate = float(_number(st["rate"], path, f"{where}.rate", upper=checks.MAX_RATE_PER_S))
        duration = float(_number(st["duration"], path, f"{where}.duration", upper=checks.MAX_DURATION_S))
        out.append((rate, duration))
    n_requests = sum(int(rate * duration) for rate, duration in out)
    if n_requests > checks.MAX_REQUESTS:
        raise InputError(
            path, f"{prefix}.stages", f"{n_requests} requests (rate x duration); expected at most {checks.MAX_REQUESTS}"
        )
    return tuple(out)


_SHAPE_FIELDS = ("system_prompt_len", "question_len", "output_len")


def _shared_prefix(cfg: dict, path: Path) -> object:
    """The shared-prefix data shape; the simulator generates no other kind of data."""
    kind = _get(cfg, "data.type", path, "shared_prefix")
    if kind != "shared_prefix":
        raise InputError(path, "data.type", f"expected shared_prefix (the data the simulator generates), got {kind!r}")
    return _get(cfg, "data.shared_prefix", path)


def _shape_from_results(cfg: dict, path: Path) -> dict[str, int]:
    sp = _shared_prefix(cfg, path)
    if not isinstance(sp, dict):
        raise InputError(path, "data.shared_prefix", "expected a mapping (the shared-prefix data shape)")
    shape = {
        k: _num_field(cfg, f"data.shared_prefix.{k}", path, integer=True, upper=checks.MAX_TOKENS)
        for k in ("num_groups", "num_prompts_per_group", *_SHAPE_FIELDS)
    }
    return _check_users(shape, path)


def _check_users(shape: dict[str, int], path: Path) -> dict[str, int]:
    users = shape["num_groups"] * shape["num_prompts_per_group"]
    if users > checks.MAX_REQUESTS:
        raise InputError(path, "data.shared_prefix", f"{users} prompts; expected at most {checks.MAX_REQUESTS}")
    return shape


def _shape_from_profile(prof: dict, path: Path) -> dict[str, int]:
    sp = _shared_prefix(prof, path)
    if not isinstance(sp, dict):
        raise InputError(path, "data.shared_prefix", "expected a mapping (the shared-prefix data shape)")
    shape = {
        k: _num_field(prof, f"data.shared_prefix.{k}", path, integer=True, upper=checks.MAX_TOKENS)
        for k in _SHAPE_FIELDS
    }
    # the profile spells the group shape differently from the resolved config
    for key, names in (
        ("num_groups", ("num_groups", "num_unique_system_prompts")),
        ("num_prompts_per_group", ("num_prompts_per_group", "num_users_per_system_prompt")),
    ):
        name = next((n for n in names if sp.get(n) is not None), None)
        if name is None:
            raise InputError(path, f"data.shared_prefix.{names[1]}", "a required field is missing")
        shape[key] = _num_field(prof, f"data.shared_prefix.{name}", path, integer=True, upper=checks.MAX_TOKENS)
    return _check_users(shape, path)


def _parse_metrics_file(path: Path) -> LifecycleMetrics:
    data = read_mapping(path, "json")
    successes = _num_field(data, "successes.count", path, integer=True, allow_zero=True)
    failures = _num_field(data, "failures.count", path, integer=True, allow_zero=True)
    means: dict[str, float | None] = {}
    distributions: dict[str, dict[str, float]] = {}
    for metric, src in LATENCY_FILE_KEYS.items():
        dotted = f"successes.latency.{src}.mean"
        if successes == 0:
            raw = _get(data, dotted, path, None)
            means[f"{metric}_mean_s"] = None if raw is None else float(_number(raw, path, dotted, allow_zero=True))
        else:  # a served request took time to answer; ITL and TPOT are 0 for one-token outputs
            means[f"{metric}_mean_s"] = float(_num_field(data, dotted, path, allow_zero=metric in ("itl", "tpot")))
        distributions[metric] = _percentiles_field(data, f"successes.latency.{src}", path)
    return LifecycleMetrics(
        successes=int(successes),
        failures=int(failures),
        **means,
        distributions={k: v for k, v in distributions.items() if v},
    )


def _percentiles_field(data: dict, dotted: str, path: Path) -> dict[str, float]:
    """The percentiles present in one latency block (``median`` is ``p50``); absent ones are left out."""
    block = _get(data, dotted, path, None)
    if not isinstance(block, dict):
        return {}
    out = {}
    for p in PERCENTILES:
        name = "median" if p == 50 else stat_key(p)
        if block.get(name) is not None:
            out[stat_key(p)] = float(_number(block[name], path, f"{dotted}.{name}", allow_zero=True))
    return out


def load_observed(results_dir: Path) -> ObservedMetrics | None:
    """The lifecycle metrics in ``results/``, or None when the run's results are withheld."""
    results_dir = Path(results_dir)
    summary_path = results_dir / Path(SUMMARY_METRICS).name
    if not summary_path.exists():
        # no summary: the results are withheld (blind test), unless stage files betray a broken copy
        stray = sorted(f.name for f in results_dir.iterdir() if _STAGE_RE.match(f.name)) if results_dir.is_dir() else []
        if stray:
            raise InputError(
                summary_path,
                None,
                f"file not found, but {stray[0]} is there; expected the run's "
                "summary metrics next to its stage metrics",
            )
        return None
    summary = _parse_metrics_file(summary_path)
    found = {}
    for f in results_dir.iterdir():
        m = _STAGE_RE.match(f.name)
        if m:
            found[int(m.group(1))] = f
    if found and sorted(found) != list(range(len(found))):
        raise InputError(
            results_dir,
            "stage_<N>_lifecycle_metrics.json",
            f"expected stages numbered 0..{len(found) - 1}, found {sorted(found)}",
        )
    stages = tuple(_parse_metrics_file(found[i]) for i in sorted(found))
    return ObservedMetrics(summary=summary, stages=stages)


def load_experiment(directory: str | Path) -> ExperimentSpec:
    """Read one experiment directory (see the module docstring for its files)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(directory, None, "expected an experiment directory (holding exp-config.yaml)")

    exp_path = directory / EXP_CONFIG
    exp = read_mapping(exp_path, "yaml")
    model = checks.text(_get(exp, "model", exp_path), exp_path, "model", "a model name (HF id)")
    tp = _num_field(exp, "tensor_parallelism", exp_path, integer=True, upper=checks.MAX_TP)
    max_model_len = _num_field(exp, "max_model_len", exp_path, integer=True, upper=checks.MAX_TOKENS)
    max_batched = _num_field(exp, "max_num_batched_tokens", exp_path, integer=True, upper=checks.MAX_STEP_TOKENS)
    max_seqs = _num_field(exp, "max_num_seqs", exp_path, integer=True, upper=checks.MAX_REQUESTS)
    gmu = checks.fraction(
        _get(exp, "gpu_memory_utilization", exp_path, DEFAULT_GPU_MEMORY_UTILIZATION),
        exp_path,
        "gpu_memory_utilization",
    )

    results_cfg_path = directory / RESULTS_CONFIG
    if results_cfg_path.exists():
        src_path = results_cfg_path
        cfg = read_mapping(results_cfg_path, "yaml")
        shape = _shape_from_results(cfg, src_path)
    else:
        src_path = directory / PROFILE
        cfg = read_mapping(src_path, "json")
        shape = _shape_from_profile(cfg, src_path)
    load = _get(cfg, "load", src_path)
    if not isinstance(load, dict):
        raise InputError(src_path, "load", "expected a mapping (load type and stages)")
    stages = _parse_stages(load, src_path, "load")
    timeout = float(
        _num_field(
            cfg, "load.request_timeout", src_path, default=DEFAULT_REQUEST_TIMEOUT_S, upper=checks.MAX_DURATION_S
        )
    )
    interval = float(
        _num_field(
            cfg,
            "load.interval",
            src_path,
            default=DEFAULT_STAGE_INTERVAL_S,
            allow_zero=True,
            upper=checks.MAX_DURATION_S,
        )
    )
    load_type = _get(cfg, "load.type", src_path, "constant")
    if load_type not in SIMULATED_LOAD_TYPES:
        raise InputError(
            src_path,
            "load.type",
            f"expected constant (the load timer the simulator reproduces: per stage, exponential gaps"
            f" rescaled to span it), got {load_type!r}",
        )

    streamed = sum(int(rate * duration) for rate, duration in stages) * int(shape["output_len"])
    if streamed > checks.MAX_SIMULATED_TOKENS:
        raise InputError(
            src_path,
            "data.shared_prefix.output_len",
            f"{streamed:.3g} output tokens to stream; expected at most {checks.MAX_SIMULATED_TOKENS:.0e}",
        )

    results_dir = directory / "results"
    if results_dir.exists() and not results_dir.is_dir():
        raise InputError(results_dir, None, "is a file; expected the folder of the run's results (or none: withheld)")
    observed = load_observed(results_dir) if results_dir.is_dir() else None
    if observed is not None and observed.stages and len(observed.stages) != len(stages):
        raise InputError(
            results_dir,
            "stage_<N>_lifecycle_metrics.json",
            f"{len(observed.stages)} stage files for the {len(stages)} load stages of {src_path.name};"
            " expected one per stage (or none)",
        )

    return ExperimentSpec(
        name=directory.name,
        model=model,
        tp=int(tp),
        stages=stages,
        num_groups=int(shape["num_groups"]),
        num_prompts_per_group=int(shape["num_prompts_per_group"]),
        system_prompt_len=int(shape["system_prompt_len"]),
        question_len=int(shape["question_len"]),
        output_len=int(shape["output_len"]),
        max_model_len=int(max_model_len),
        max_num_batched_tokens=int(max_batched),
        max_num_seqs=int(max_seqs),
        gpu_memory_utilization=gmu,
        request_timeout_s=timeout,
        stage_interval_s=interval,
        load_type=load_type,
        observed=observed,
        path=str(directory),
    )


def _broken_copy(folder: Path) -> bool:
    """FOLDER holds an experiment's own files (its load profile, or lifecycle results) but
    no exp-config.yaml: a broken copy, not an unrelated folder (any folder may have a
    ``results/`` of its own)."""
    results = folder / "results"
    return (folder / PROFILE).exists() or (results.is_dir() and any(results.glob("*lifecycle_metrics.json")))


def _experiment_dirs(folder: Path, seen: set[Path] | None = None):
    """The experiment folders below FOLDER, at any depth, skipping hidden folders."""
    seen = seen if seen is not None else {folder.resolve()}
    for d in sorted(folder.iterdir(), key=lambda d: d.name):
        if not d.is_dir() or d.name.startswith("."):
            continue
        if (d / EXP_CONFIG).exists():
            yield d  # an experiment's own folder is not searched further
        elif _broken_copy(d):
            # skipping it would drop the experiment without a word
            msg = "file not found, beside the experiment's other files; expected both"
            raise InputError(d / EXP_CONFIG, None, msg)
        elif d.resolve() not in seen:  # a folder reached twice (a symbolic link's loop) is searched once
            seen.add(d.resolve())
            yield from _experiment_dirs(d, seen)


def find_experiments(root: str | Path) -> list[ExperimentSpec]:
    """Every directory below ROOT holding ``exp-config.yaml`` (ROOT itself if it is one), by name.

    Any depth is searched (``exps/h100/<run>/`` as well as ``exps/<run>/``).
    """
    root = Path(root)
    if not root.is_dir():
        raise InputError(root, None, "expected a directory of experiment directories")
    if (root / EXP_CONFIG).exists():
        return [load_experiment(root)]
    dirs: dict[str, Path] = {}
    by_target: dict[Path, Path] = {}
    for d in _experiment_dirs(root):
        if d.name in dirs:  # the folder's name is the experiment's name in every table and JSON
            raise InputError(d, None, f"two experiments named {d.name!r} (the other: {dirs[d.name]}); expected one")
        other = by_target.setdefault(d.resolve(), d)
        if other != d:  # links: one experiment would be scored twice, under two names
            raise InputError(d, None, f"the same experiment folder as {other}; expected each experiment once")
        dirs[d.name] = d
    if not dirs:
        msg = "no experiment directory (holding exp-config.yaml) at any depth below this directory"
        raise InputError(root, EXP_CONFIG, msg)
    return [load_experiment(dirs[name]) for name in sorted(dirs)]


__all__ = [
    "DEFAULT_MAX_MODEL_LEN",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "ExperimentSpec",
    "LifecycleMetrics",
    "ObservedMetrics",
    "find_experiments",
    "load_experiment",
    "load_observed",
]
