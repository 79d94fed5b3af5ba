"""The compiled simulator core (``fitness.sim.core``) gives the Python loop's results, bit for bit.

Every scenario runs twice, ``engine="python"`` (the reference loop over
``fitness.sim.scheduler``) and ``engine="compiled"``, and every field of the two results
(per-request latencies, the recorded batches, the step log, the token times, the KV
counters) must be equal: not close, equal.
"""

from __future__ import annotations

import dataclasses
import linecache

import cloudpickle
import numpy as np
import pytest

from fitness.sim.engine import simulate, step_program_of
from fitness.sim.models import (
    REFERENCE_EXPRESSION,
    AnchoredModel,
    ExpressionLatencyModel,
    PhysicsLatencyModel,
    reference_model,
)
from primitives.data.experiments import find_experiments
from primitives.data.roots import shared_data_root
from primitives.deployment import DeploymentResolver
from primitives.program import Unsupported
from primitives.program_eval import evaluate
from tests.test_sim_scheduler import DEP, plan_, spec_

KERNEL_EXPR = (
    "300 + 0.7*gemm_time_us + 0.5*decode_attention_time_us + 0.8*prefill_attention_time_us + 1.1*kv_io_time_us"
)


def differences(a, b, path: str = "") -> list[str]:
    """Paths of the fields where A and B differ (NaN equals NaN)."""
    if dataclasses.is_dataclass(a):
        return [
            d
            for f in dataclasses.fields(a)
            for d in differences(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
        ]
    if isinstance(a, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            return [f"{path} (length)"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        same = a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f" and b.dtype.kind == "f")
        return [] if same else [path]
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return []
    return [] if a == b else [path]


def both(spec, dep, model, **kw):
    py = simulate(spec, dep, model, engine="python", **kw)
    compiled = simulate(spec, dep, model, engine="compiled", **kw)
    return py, compiled


def expr_model(expr: str, dep=DEP, **overheads) -> ExpressionLatencyModel:
    return ExpressionLatencyModel(expr, dep, {"queueing_base_us": 1000.0, **overheads})


SCENARIOS = {
    # two stages, chunked prefill, prefix hits
    "busy": dict(
        spec=spec_(stages=((30.0, 6.0), (60.0, 3.0)), max_num_batched_tokens=200, max_num_seqs=6, output_len=30),
        expr="8000 + 10*prefill_tokens + 2*decode_tokens",
        kw=dict(seed=1, kv_capacity_blocks=10_000),
        # the load term reorders enqueues: a later request can overtake an earlier one
        overheads=dict(queueing_per_running_request_us=2500.0, queueing_per_input_token_us=30.0),
    ),
    # KV too small for the batch: preemption and recompute, with the preemption overhead
    "preemption": dict(
        spec=spec_(max_num_seqs=8, max_num_batched_tokens=512),
        expr="5000 + 3*kv_tokens",
        load=([60] * 12, [0] * 12, list(range(12)), np.linspace(0, 0.05, 12), list(range(12)), 100),
        kw=dict(kv_capacity_blocks=40),
        overheads=dict(preemption_processing_us=300.0, scheduling_processing_us=50.0),
    ),
    # client timeouts while running and while waiting, then late requests
    "timeouts": dict(
        spec=spec_(max_num_seqs=2),
        expr="50000",
        load=([40] * 12, [0] * 12, list(range(12)), [0.0] * 10 + [4.5, 4.5], list(range(12)), 30, 4.0),
        kw=dict(kv_capacity_blocks=12),
    ),
    # prompts longer than the model allows are rejected
    "too long": dict(
        spec=spec_(max_model_len=4096),
        expr="10000",
        load=([4000, 40], [0, 0], [0, 1], [0.0, 0.1], [0, 1], 200),
        kw=dict(kv_capacity_blocks=1000),
        overheads=dict(queueing_per_running_request_us=700.0),
    ),
    # a cache too small for every prefix: LRU eviction of cached blocks
    "lru eviction": dict(
        spec=spec_(stages=((20.0, 4.0),), num_groups=6, num_prompts_per_group=4, max_num_seqs=4, output_len=12),
        expr="6000 + 4*prefill_tokens + max(20*num_decode_reqs, 0.01*kv_tokens)",
        kw=dict(seed=3, kv_capacity_blocks=60),
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_compiled_core_equals_python_loop(name):
    sc = SCENARIOS[name]
    kw = dict(sc["kw"], distributions=True)
    if "load" in sc:
        kw["load"] = plan_(*sc["load"])
    model = expr_model(sc["expr"], **sc.get("overheads", {}))
    py, compiled = both(sc["spec"], DEP, model, **kw)
    assert differences(py, compiled) == []
    assert py.n_steps > 0


def test_a_request_rejected_after_its_stage_drained_still_delays_the_next_stage():
    # stage 0: one short request at 0 s, then a too-long one sent at 1.5 s, when the first
    # has long finished: the client still waits for the rejection (send + queueing time)
    # before the next stage starts, and both engines agree
    plan = dataclasses.replace(
        plan_([4095, 40], [0, 0], [0, 1], [0.0, 1.5], [1, 0, 1], 3),
        request_stage=np.array([0, 0, 1]),
        stage_offsets_s=(np.array([0.0, 1.5]), np.array([0.0])),
        stage_first_request=np.array([0, 2, 3]),
        stage_interval_s=0.25,
    )
    over = dict(queueing_base_us=2000.0, queueing_per_running_request_us=700.0)
    py, compiled = both(spec_(max_model_len=4096), DEP, expr_model("10000", **over), load=plan, kv_capacity_blocks=1000)
    assert differences(py, compiled) == []
    rejected = py.requests.enqueue_us[1]
    assert rejected == pytest.approx(1.5e6 + 2000.0 + 700.0)  # the last step (1 request) before it was sent
    assert py.stage_start_us[1] == pytest.approx(rejected + 0.25e6)


def test_anchored_kernel_model_is_compiled_and_equal():
    dep = DeploymentResolver().resolve("mistralai/Mixtral-8x7B-v0.1", 2)
    spec = spec_(model="mistralai/Mixtral-8x7B-v0.1", tp=2, stages=((40.0, 3.0),), max_num_seqs=16, output_len=40)
    model = AnchoredModel(expr_model(KERNEL_EXPR, dep), 1.37)
    assert step_program_of(model) is not None
    py, compiled = both(spec, dep, model, seed=2, kv_capacity_blocks=400, distributions=True)
    assert differences(py, compiled) == []


def test_step_program_gives_the_models_bits_on_random_batches():
    dep = DeploymentResolver().resolve("meta-llama/Llama-2-70b-hf", 4)
    rng = np.random.default_rng(0)
    exprs = [KERNEL_EXPR, REFERENCE_EXPRESSION, "pdiv(weight_time_us, num_prefill_reqs) + sqrt(kv_tokens)"]
    for expr in exprs:
        model = expr_model(expr, dep)
        program = model.step_program()
        for _ in range(200):
            n = int(rng.integers(1, 129))
            progress = rng.integers(0, 4000, n).astype(float)
            new = np.where(rng.random(n) < 0.1, rng.integers(1, 2048, n), 1).astype(float)
            inl = rng.integers(16, 4000, n).astype(float)
            outl = rng.integers(0, 500, n).astype(float)
            assert evaluate(program, progress, new, inl, outl) == model.step_time_us(progress, new, inl, outl)


def test_models_without_a_program_run_on_the_python_loop():
    model = PhysicsLatencyModel(deployment=DEP)
    assert step_program_of(model) is None
    with pytest.raises(Unsupported):
        step_program_of(model, required=True)
    res = simulate(spec_(), DEP, model, engine="auto", kv_capacity_blocks=1000)
    assert res.metrics.summary.successes > 0


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="unknown engine"):
        simulate(spec_(), DEP, expr_model("1000"), engine="fast")


def _real_experiment(suffix: str):
    root = shared_data_root() / "data" / "experiments"
    if not root.is_dir():
        pytest.skip(f"the real experiments are not at {root} (set STEPSYNTH_SHARED)")
    return next(s for s in find_experiments(root) if s.name.endswith(suffix))


def test_real_overloaded_run_is_equal():
    # the reasoning run overloads the server: long prompts, timeouts, preemption under a small cache
    spec = _real_experiment("codellama-34b-tp2-reasoning")
    dep = DeploymentResolver().resolve(spec.model, spec.tp)
    model = AnchoredModel(reference_model(dep), 1.3)
    py, compiled = both(spec, dep, model, kv_capacity_blocks=3000, distributions=True)
    assert py.total_preemptions > 0 and py.metrics.summary.failures > 0
    assert differences(py, compiled) == []


def test_a_model_received_by_a_worker_still_compiles():
    # loky/Dask workers get models pickled: the lambdified source is no longer in linecache
    model = cloudpickle.loads(cloudpickle.dumps(expr_model(KERNEL_EXPR + " + pdiv(kv_tokens, batch_size)")))
    linecache.clearcache()
    program = model.step_program()
    batch = (np.array([100.0, 900.0]), np.array([1.0, 300.0]), np.array([120.0, 1200.0]), np.array([4.0, 0.0]))
    assert evaluate(program, *batch) == model.step_time_us(*batch)


def test_a_worker_never_compiles_another_function_filed_under_the_models_name():
    # sympy files each printed function under <lambdifygenerated-N>, N counting per process: in a
    # worker, the N a pickled model brings may name a function the worker printed itself
    model = cloudpickle.loads(cloudpickle.dumps(expr_model(KERNEL_EXPR + " + 2*batch_size")))
    filed = model._scalar_fn.__code__.co_filename
    other = "def _lambdifygenerated(n_layers):\n    return n_layers\n"
    linecache.cache[filed] = (len(other), None, other.splitlines(True), filed)
    try:
        program = model.step_program()
    finally:
        linecache.cache.pop(filed, None)
    batch = (np.array([100.0, 900.0]), np.array([1.0, 300.0]), np.array([120.0, 1200.0]), np.array([4.0, 0.0]))
    assert evaluate(program, *batch) == model.step_time_us(*batch) > 100.0
