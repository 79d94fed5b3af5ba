"""KV semantics of real step traces: distinct blocks, turned into the per-request sum.

vLLM's ``kv.blocks_*`` counters count distinct blocks: a prefix that 40 running requests
share counts once. The ``kv_tokens`` feature (and BLIS, which sums over requests) counts
it 40 times, because each request's attention reads it. Fitting a KV cost on the traces'
distinct count would inflate it by the workload's sharing. So, for a trace experiment
whose folder is under ``--experiments``, the simulator runs that experiment's workload
once (reference model, same seed), measures the ratio of the two counts over its steps
(``kv_sharing_factor``) and the trace's KV is scaled by it. Traces with per-request rows
need nothing: their ``kv_tokens`` is summed from the requests.
"""

from __future__ import annotations

from pathlib import Path

from fitness.sim.engine import simulate
from fitness.sim.loadgen import check_servable
from fitness.sim.models import reference_model
from fitness.sim.recording import kv_sharing_factor
from primitives.data.experiments import find_experiments
from primitives.data.traces import StepData
from primitives.deployment import DeploymentResolver


def run_seed(run_config: dict | None) -> int:
    """The load seed an archived run drew its workloads with, and so measured its KV sharing
    on (0 for a run that recorded none)."""
    return int((run_config or {}).get("seed") or 0)


def trace_kv_sharing(
    data: StepData, experiments_dir: str | Path | None, resolver: DeploymentResolver, seed: int = 0
) -> dict[str, float]:
    """Experiment name -> factor for the block-counted traces that have an experiment folder."""
    if data.requests is not None or not experiments_dir:
        return {}
    specs = {s.name: s for s in find_experiments(Path(experiments_dir))}
    out: dict[str, float] = {}
    for name in data.experiments:
        spec = specs.get(name)
        if spec is None:
            continue
        dep = resolver.resolve_experiment(spec)
        check_servable(spec, dep)  # a simulation without a served request has no sharing to measure
        result = simulate(spec, dep, reference_model(dep), seed=seed, record=True)
        out[name] = round(kv_sharing_factor(result.trajectory), 4)
    return out


__all__ = ["trace_kv_sharing"]
