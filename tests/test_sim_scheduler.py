"""The simulated vLLM V1 scheduler: budget, slots, FCFS, prefix caching, preemption, timeouts, timing."""

from __future__ import annotations

import numpy as np
import pytest

from fitness.sim.engine import simulate
from fitness.sim.latency_model import NON_STEP_NAMES, NonStepTerms
from fitness.sim.loadgen import LoadPlan, PromptShapes, build_load
from fitness.sim.models import ExpressionLatencyModel, PhysicsLatencyModel, make_model
from fitness.sim.recording import ABORTED, FINISHED
from primitives.compute import features_from_requests
from primitives.data.experiments import ExperimentSpec
from primitives.deployment import DeploymentResolver

DEP = DeploymentResolver().resolve("meta-llama/Llama-2-7b-hf", 1)


class ConstModel(NonStepTerms):
    """step = base + per_token * tokens; constant queueing; explicit overheads."""

    def __init__(
        self, step_us=10_000.0, per_token_us=0.0, q_us=1_000.0, otp_us=0.0, sched_us=0.0, pre_us=0.0, gap_us=25.0
    ):
        super().__init__(
            queueing_base_us=q_us,
            output_token_processing_us=otp_us,
            scheduling_processing_us=sched_us,
            preemption_processing_us=pre_us,
            event_gap_us=gap_us,
        )
        self.step_us, self.per_token_us = step_us, per_token_us

    def step_time_us(self, progress, new_tokens, input_len, output_len):
        return self.step_us + self.per_token_us * float(new_tokens.sum())


def spec_(**kw) -> ExperimentSpec:
    base = dict(
        name="t-general",
        model="meta-llama/Llama-2-7b-hf",
        tp=1,
        stages=((4.0, 10.0),),
        num_groups=2,
        num_prompts_per_group=3,
        system_prompt_len=40,
        question_len=60,
        output_len=20,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        stage_interval_s=0.5,
    )
    base.update(kw)
    return ExperimentSpec(**base)


def plan_(prompt_len, system_len, user_group, sends_s, requests_user, output_len, timeout_s=300.0) -> LoadPlan:
    """A hand-made single-stage load: explicit prompts, users and send times."""
    sends = np.asarray(sends_s, dtype=float)
    n = len(sends)
    return LoadPlan(
        shapes=PromptShapes(
            group_system_len=np.asarray(system_len),
            user_group=np.asarray(user_group),
            user_prompt_len=np.asarray(prompt_len),
        ),
        output_len=output_len,
        request_user=np.asarray(requests_user, dtype=np.int64),
        request_stage=np.zeros(n, dtype=np.int64),
        stage_offsets_s=(sends,),
        stage_first_request=np.array([0, n]),
        timeout_s=timeout_s,
        stage_interval_s=0.0,
    )


def rows_of(traj, r):
    """(step, progress, new, output_len) rows of request r, in step order."""
    sel = traj.batch_request == r
    steps = traj.batch_step[sel]
    return steps, traj.batch_progress[sel], traj.batch_new_tokens[sel], traj.batch_output_len[sel]


# --- invariants on a busy synthetic run ---------------------------------------------


@pytest.fixture(scope="module")
def busy():
    spec = spec_(stages=((30.0, 6.0), (60.0, 3.0)), max_num_batched_tokens=200, max_num_seqs=6, output_len=30)
    res = simulate(spec, DEP, ConstModel(step_us=8_000, per_token_us=10.0), seed=1, kv_capacity_blocks=10_000)
    return spec, res


def test_budget_and_slots_never_exceeded(busy):
    spec, res = busy
    tr = res.trajectory
    step = tr.batch_step
    assert np.bincount(step, weights=tr.batch_new_tokens, minlength=tr.n_steps).max() <= spec.max_num_batched_tokens
    sizes = np.diff(tr.step_offsets)
    assert sizes.max() <= spec.max_num_seqs and sizes.min() >= 1
    assert sizes.max() == spec.max_num_seqs  # the load does saturate the slots
    assert res.extra["kv_free_blocks_at_end"] == 10_000 and res.extra["kv_blocks_held_at_end"] == 0
    assert tr.batch_new_tokens.min() >= 1


def test_fcfs_and_exact_output(busy):
    spec, res = busy
    tr = res.trajectory
    assert res.total_preemptions == 0
    order = np.argsort(res.requests.enqueue_us, kind="stable")
    assert np.all(np.diff(tr.admit_step[order]) >= 0)  # admitted in enqueue order
    assert np.all(res.requests.status == FINISHED) and res.requests.success.all()
    assert np.all(res.requests.output_tokens == spec.output_len)
    # each request's rows: progress advances by what it computed; tokens only once the prompt is in
    for r in range(0, res.requests.n, 37):
        steps, prog, new, outl = rows_of(tr, r)
        assert np.all(np.diff(steps) == 1)  # scheduled every step from admission to the end
        assert np.array_equal(prog[1:], (prog + new)[:-1])
        L = res.requests.input_len[r]
        assert prog[0] == res.requests.prefix_hit_tokens[r]
        assert prog[-1] + new[-1] == L + spec.output_len - 1  # the last token is sampled, never fed back
        assert tr.first_token_step[r] == steps[np.flatnonzero(prog + new == L)[0]]
        assert tr.last_step[r] == steps[-1]


def test_stages_run_one_after_another(busy):
    spec, res = busy
    rq = res.requests
    s0, s1 = rq.stage == 0, rq.stage == 1
    drained = np.nanmax(rq.send_us[s0] + rq.e2e_us[s0])
    assert rq.send_us[s1].min() >= drained + spec.stage_interval_s * 1e6
    assert res.stage_start_us[1] >= drained
    assert len(res.metrics.stages) == 2 and res.metrics.stages[1].successes == int(s1.sum())


def test_features_in_bulk(busy):
    _, res = busy
    tr = res.trajectory
    feats = tr.features()
    for k in (0, 5, tr.n_steps // 2, tr.n_steps - 1):
        one = features_from_requests(
            np.zeros(tr.step_offsets[k + 1] - tr.step_offsets[k], dtype=np.int64), *tr.batch(k), 1
        )
        for name, col in feats.items():
            assert col[k] == pytest.approx(one[name][0])
    assert feats["prefill_tokens"].sum() + feats["decode_tokens"].sum() == tr.batch_new_tokens.sum()


def test_seeded(busy):
    spec, res = busy
    again = simulate(spec, DEP, ConstModel(step_us=8_000, per_token_us=10.0), seed=1, kv_capacity_blocks=10_000)
    assert np.array_equal(again.trajectory.step_start_us, res.trajectory.step_start_us)
    assert again.metrics == res.metrics


# --- prefix caching on a hand-built case ---------------------------------------------


def test_prefix_cache_hits():
    # group 0: system prompt of 40 tokens = 2 full blocks + 8 tokens; group 1 apart
    prompt = [70, 64, 150]
    system = [40, 40]
    group = [0, 0, 1]
    # requests far apart, so each runs alone: u0, u1, u0, u1, u2
    plan = plan_(prompt, system, group, [0.0, 1.0, 2.0, 3.0, 4.0], [0, 1, 0, 1, 2], output_len=3)
    res = simulate(spec_(), DEP, ConstModel(), load=plan, kv_capacity_blocks=1000)
    hits = res.requests.prefix_hit_tokens.tolist()
    # u0 first: nothing; u1: the group's 2 system blocks (block 2 holds user tokens);
    # u0 again: its 4 full blocks (64 of 70); u1 again: 64 = 4 full blocks, capped at 3 (48);
    # u2 (another group): nothing
    assert hits == [0, 32, 64, 48, 0]
    tr = res.trajectory
    for r, L in enumerate([70, 64, 70, 64, 150]):
        k = tr.admit_step[r]
        steps, prog, new, _ = rows_of(tr, r)
        assert steps[0] == k and prog[0] == hits[r] and new[0] == L - hits[r]


def test_prefix_hits_blocks_scheduled_in_the_same_step():
    # two users of one group arrive together: the second one hits the first one's system
    # blocks, registered as soon as they are scheduled
    plan = plan_([70, 64], [40], [0, 0], [0.0, 0.0], [0, 1], output_len=2)
    res = simulate(spec_(), DEP, ConstModel(), load=plan, kv_capacity_blocks=1000)
    assert res.requests.prefix_hit_tokens.tolist() == [0, 32]
    assert res.trajectory.admit_step.tolist() == [0, 0]


def test_lru_eviction():
    # u0 (70 prompt tokens + 2 fed-back outputs -> 5 blocks: 2 system, 2 user, 1 partial)
    # finishes; its blocks stay cached, freed tail first. u2's 150-token prompt then takes
    # 10 blocks: never-used ones first, then the oldest freed ones.
    plan = plan_([70, 64, 150], [40, 40], [0, 0, 1], [0.0, 1.0, 2.0], [0, 2, 0], output_len=3)

    def hits(capacity):
        res = simulate(spec_(), DEP, ConstModel(), load=plan, kv_capacity_blocks=capacity)
        return res.requests.prefix_hit_tokens.tolist()

    assert hits(10) == [0, 0, 0]  # 5 fresh + all 5 of u0's: everything evicted
    assert hits(12) == [0, 0, 32]  # 7 fresh + partial, user, user: the system head survives
    assert hits(14) == [0, 0, 64]  # 9 fresh + the partial block only
    assert hits(15) == [0, 0, 64]


# --- chunked prefill ------------------------------------------------------------------


def test_chunked_prefill():
    plan = plan_([150], [10], [0], [0.0], [0], output_len=4)
    res = simulate(spec_(max_num_batched_tokens=64), DEP, ConstModel(), load=plan, kv_capacity_blocks=100)
    steps, prog, new, outl = rows_of(res.trajectory, 0)
    assert prog.tolist() == [0, 64, 128, 150, 151, 152]
    assert new.tolist() == [64, 64, 22, 1, 1, 1]
    assert outl.tolist() == [0, 0, 0, 1, 2, 3]  # partial prefills return no token
    assert res.trajectory.first_token_step[0] == 2


# --- preemption ------------------------------------------------------------------------


def test_preemption_and_recompute():
    n = 12
    # distinct users (no shared blocks): 60-token prompts, 100 output tokens -> up to 10
    # blocks each; 40 blocks cannot hold 8 of them
    plan = plan_([60] * n, [0] * n, list(range(n)), np.linspace(0, 0.05, n), list(range(n)), output_len=100)
    spec = spec_(max_num_seqs=8, max_num_batched_tokens=512)
    res = simulate(spec, DEP, ConstModel(step_us=5_000, pre_us=300.0), load=plan, kv_capacity_blocks=40)
    tr = res.trajectory
    assert res.total_preemptions > 0 and tr.step_preemptions.sum() == res.total_preemptions
    assert res.extra["kv_free_blocks_at_end"] == 40 and res.extra["kv_blocks_held_at_end"] == 0  # no leak
    assert res.requests.success.all() and np.all(res.requests.output_tokens == 100)
    # KV blocks held by the batch never exceed the capacity
    blocks = -(-(tr.batch_progress.astype(np.int64) + tr.batch_new_tokens) // 16)
    assert np.bincount(tr.batch_step, weights=blocks).max() <= 40
    # no admission in a step that preempted
    pre_steps = np.flatnonzero(tr.step_preemptions > 0)
    assert not np.isin(tr.admit_step, pre_steps).any()
    # the preemption overhead lands in the cycle
    assert np.allclose(tr.step_cycle_us - tr.step_time_us, 300.0 * tr.step_preemptions)
    # a preempted request recomputes from scratch (or from its cached blocks) with its output so far
    victim = int(np.flatnonzero(res.requests.preemptions > 0)[0])
    steps, prog, new, outl = rows_of(tr, victim)
    restart = np.flatnonzero(np.diff(steps) > 1)[0] + 1
    assert outl[restart] > 0 and prog[restart] < prog[restart - 1]
    assert prog[restart] % 16 == 0  # a whole number of cached blocks (maybe 0)
    assert outl[restart + 1] == outl[restart] + 1 if restart + 1 < len(outl) else True
    assert prog[-1] + new[-1] == 60 + 100 - 1


# --- timeouts ---------------------------------------------------------------------------


def test_timeouts_fail_and_free_the_engine():
    # each request alone takes 30 steps of 50 ms = 1.5 s; 10 of them at once on 2 slots with
    # a 4 s timeout: pairs 1-2 succeed, pair 3 is aborted while running, pairs 4-5 while
    # waiting; two late requests then find the slots and blocks free again
    n = 12
    sends = [0.0] * 10 + [4.5, 4.5]
    plan = plan_([40] * n, [0] * n, list(range(n)), sends, list(range(n)), output_len=30, timeout_s=4.0)
    res = simulate(spec_(max_num_seqs=2), DEP, ConstModel(step_us=50_000), load=plan, kv_capacity_blocks=12)
    rq, tr = res.requests, res.trajectory
    assert rq.success.tolist() == [True] * 4 + [False] * 6 + [True] * 2
    assert res.extra["kv_free_blocks_at_end"] == 12 and res.extra["kv_blocks_held_at_end"] == 0
    assert np.all(rq.e2e_us[rq.success] <= 4.0e6)
    assert np.all(np.isnan(rq.e2e_us[~rq.success]))
    assert (res.metrics.summary.successes, res.metrics.summary.failures) == (6, 6)
    assert res.metrics.summary.e2e_mean_s == pytest.approx(np.nanmean(rq.e2e_us) / 1e6)
    assert np.all(rq.status[4:10] == ABORTED)
    assert np.all(tr.admit_step[4:6] >= 0) and np.all(rq.output_tokens[4:6] > 0)  # aborted while running
    assert np.all(tr.admit_step[6:10] == -1)  # aborted while waiting: never ran
    # no step runs an aborted request after its deadline
    dead = np.isin(tr.batch_request, np.arange(4, 10))
    assert tr.step_start_us[tr.batch_step[dead]].max() < 4.0e6


def test_all_time_out():
    plan = plan_([40] * 3, [0] * 3, [0, 1, 2], [0.0, 0.1, 0.2], [0, 1, 2], output_len=100, timeout_s=2.0)
    res = simulate(spec_(), DEP, ConstModel(step_us=50_000), load=plan, kv_capacity_blocks=1000)
    assert res.metrics.summary.successes == 0 and res.metrics.summary.failures == 3
    assert res.metrics.summary.e2e_mean_s is None


def test_too_long_is_rejected():
    plan = plan_([4000, 40], [0, 0], [0, 1], [0.0, 0.1], [0, 1], output_len=200)
    res = simulate(spec_(max_model_len=4096), DEP, ConstModel(), load=plan, kv_capacity_blocks=1000)
    assert res.requests.success.tolist() == [False, True]


# --- asynchronous timing ------------------------------------------------------------


def test_single_request_timing():
    c, q, otp, gap, sched = 10_000.0, 1_500.0, 300.0, 25.0, 200.0
    m = ConstModel(step_us=c - sched, q_us=q, otp_us=otp, gap_us=gap, sched_us=sched)
    N = 20
    plan = plan_([100], [0], [0], [0.0], [0], output_len=N)
    res = simulate(spec_(), DEP, m, load=plan, kv_capacity_blocks=100)
    rq = res.requests
    assert np.allclose(res.trajectory.step_cycle_us, c)
    # token 1 is sampled by step 0 and reaches the client at the end of step 1
    assert rq.ttft_us[0] == pytest.approx(q + 2 * c + otp)
    # the last step's tokens leave at its own end (the engine idles afterwards)
    assert rq.e2e_us[0] == pytest.approx(q + N * c + otp + gap)
    assert rq.tpot_us[0] == pytest.approx((rq.e2e_us[0] - rq.ttft_us[0]) / (2 * N - 1))


def test_finished_request_holds_its_slot_one_more_schedule():
    # async scheduling: a request finishing at step l keeps its slot while step l+1 is
    # scheduled. With one slot the engine must first process step l's outputs: the next
    # request starts right after, and step l's tokens are not delayed by step l+1.
    c, q, N = 10_000.0, 1_000.0, 5
    plan = plan_([100, 100], [0, 0], [0, 1], [0.0, 0.0], [0, 1], output_len=N)
    res = simulate(
        spec_(max_num_seqs=1), DEP, ConstModel(step_us=c, q_us=q, gap_us=0.0), load=plan, kv_capacity_blocks=100
    )
    tr, rq = res.trajectory, res.requests
    assert tr.last_step[0] == N - 1 and tr.admit_step[1] == N
    assert tr.next_contiguous[N - 1] and not tr.output_delayed[N - 1]
    assert rq.e2e_us[0] == pytest.approx(q + N * c)
    assert rq.ttft_us[1] == pytest.approx(q + N * c + 2 * c)
    assert rq.e2e_us[1] == pytest.approx(q + 2 * N * c)
    # with two slots, the second request runs alongside
    res2 = simulate(
        spec_(max_num_seqs=2), DEP, ConstModel(step_us=c, q_us=q, gap_us=0.0), load=plan, kv_capacity_blocks=100
    )
    assert res2.trajectory.admit_step.tolist() == [0, 0]


def test_enqueued_mid_step_waits_for_the_next():
    c, q = 10_000.0, 1_000.0
    plan = plan_([100, 100], [0], [0, 0], [0.0, 0.0035], [0, 0], output_len=10)
    res = simulate(spec_(), DEP, ConstModel(step_us=c, q_us=q), load=plan, kv_capacity_blocks=100)
    tr = res.trajectory
    assert tr.enq_step[1] == 0 and tr.enq_frac[1] == pytest.approx(0.35)
    assert tr.admit_step[1] == 1
    assert res.requests.ttft_us[1] == pytest.approx(q + 0.65 * c + 2 * c)
    assert tr.enq_step[0] == -1 and tr.wait_from_step[0] == 0


def test_physics_model_runs_a_real_shape_at_the_real_per_token_time():
    spec = spec_(
        stages=((8.0, 20.0),),
        num_groups=10,
        num_prompts_per_group=10,
        system_prompt_len=100,
        question_len=447,
        output_len=248,
        max_num_batched_tokens=2048,
        max_num_seqs=128,
    )
    dep = DeploymentResolver().resolve("meta-llama/Llama-2-70b-hf", 4)
    model = PhysicsLatencyModel(deployment=dep, per_layer_us=15.0, allreduce_latency_us=18.0, queueing_base_us=9_000)
    res = simulate(spec, dep, model, seed=0, record=False)
    assert res.trajectory is None
    s = res.metrics.summary
    assert s.successes == 160 and s.failures == 0
    assert 0.015 < (s.e2e_mean_s - s.ttft_mean_s) / 248 < 0.03  # per-token time near the real ~19 ms
    assert s.itl_mean_s == pytest.approx((s.e2e_mean_s - s.ttft_mean_s) / (2 * 248 - 1), rel=0.02)
    # after the first round users hit their whole prompt
    load = build_load(spec, 0)
    second_round = np.arange(res.requests.n) >= load.shapes.num_users
    L = res.requests.input_len[second_round]
    assert np.all(res.requests.prefix_hit_tokens[second_round] == (L - 1) // 16 * 16)


def test_model_registry_builds_every_model_with_every_attribute():
    expr = make_model("expression", DEP, expr="1000 + 10*batch_size", overheads={"queueing_base_us": 5.0})
    phys = make_model("physics", DEP, per_layer_us=15.0)
    anchored = make_model("anchored", DEP, model=expr, scale=2.0)
    assert isinstance(expr, ExpressionLatencyModel) and isinstance(phys, PhysicsLatencyModel)
    assert phys.per_layer_us == 15.0
    batch = (np.array([10]), np.array([1]), np.array([10]), np.array([0]))
    assert anchored.step_time_us(*batch) == 2.0 * expr.step_time_us(*batch)
    for model in (expr, phys, anchored):  # the simulator looks up no defaults
        assert all(isinstance(getattr(model, n), float) for n in (*NON_STEP_NAMES, "event_gap_us"))
    assert anchored.queueing_base_us == 5.0 and phys.queueing_base_us == 0.0
    with pytest.raises(ValueError, match="expression, physics, anchored"):
        make_model("roofline", DEP)
