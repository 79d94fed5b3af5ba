"""Teacher-forced replay: exact on the recorded trajectory, linear in the step times."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_replay_rows

from fitness.sim.engine import simulate
from fitness.sim.latency_model import SIMULATED_NON_STEP_NAMES, NonStepTerms
from fitness.sim.replay import evaluate_weights, metric_weights, replay, replay_times
from primitives.data.experiments import ExperimentSpec
from primitives.deployment import DeploymentResolver

DEP = DeploymentResolver().resolve("meta-llama/Llama-2-7b-hf", 1)


class Model(NonStepTerms):
    """Per-token + per-KV-token step time, with every non-step term."""

    def step_time_us(self, progress, new_tokens, input_len, output_len):
        return 6_000.0 + 15.0 * float(new_tokens.sum()) + 0.05 * float(progress.sum()) + 30.0 * len(new_tokens)


def _spec(**kw) -> ExperimentSpec:
    base = dict(
        name="t-general",
        model="meta-llama/Llama-2-7b-hf",
        tp=1,
        stages=((25.0, 5.0), (50.0, 3.0)),
        num_groups=3,
        num_prompts_per_group=4,
        system_prompt_len=60,
        question_len=200,
        output_len=40,
        max_num_batched_tokens=256,
        max_num_seqs=12,
        stage_interval_s=0.2,
    )
    base.update(kw)
    return ExperimentSpec(**base)


MODEL = Model(
    queueing_base_us=2_000.0,
    queueing_per_input_token_us=3.0,
    queueing_per_running_request_us=150.0,
    output_token_processing_us=400.0,
    scheduling_processing_us=700.0,
    preemption_processing_us=900.0,
    event_gap_us=30.0,
)


@pytest.fixture(scope="module")
def runs():
    # one run without and one with preemptions (small KV) and timeouts
    plain = simulate(_spec(), DEP, MODEL, seed=2, kv_capacity_blocks=5_000)
    tight = simulate(_spec(request_timeout_s=3.0), DEP, MODEL, seed=2, kv_capacity_blocks=60)
    assert plain.total_preemptions == 0
    assert tight.total_preemptions > 0 and tight.metrics.summary.failures > 0
    return plain, tight


def _close(a, b, rel=1e-9):
    assert a.successes == b.successes and a.failures == b.failures
    for k in ("e2e_mean_s", "ttft_mean_s", "itl_mean_s", "tpot_mean_s"):
        assert getattr(a, k) == pytest.approx(getattr(b, k), rel=rel), k


@pytest.mark.parametrize("which", [0, 1])
def test_replay_reproduces_closed_loop(runs, which):
    res = runs[which]
    tr = res.trajectory
    rep = replay(tr, tr.step_time_us, MODEL)
    _close(rep.summary, res.metrics.summary)
    for a, b in zip(rep.stages, res.metrics.stages, strict=True):
        _close(a, b)
    t = replay_times(tr, tr.step_time_us, MODEL)
    ok = res.requests.success
    assert np.allclose(t.e2e_us, res.requests.e2e_us[ok], rtol=0, atol=1e-3)
    assert np.allclose(t.ttft_us, res.requests.ttft_us[ok], rtol=0, atol=1e-3)


@pytest.mark.parametrize("which", [0, 1])
def test_linear_forms_match_replay(runs, which):
    tr = runs[which].trajectory
    forms = metric_weights(tr)
    assert {"e2e", "ttft", "itl", "tpot", "stage_0/e2e", "stage_1/itl"} <= set(forms)
    rng = np.random.default_rng(0)
    for _ in range(3):
        step = tr.step_time_us * rng.uniform(0.5, 1.5, size=tr.n_steps)
        over = NonStepTerms(
            **{n: rng.uniform(0, 3_000) for n in SIMULATED_NON_STEP_NAMES}, event_gap_us=rng.uniform(0, 50)
        )
        rep = replay(tr, step, over)
        val = evaluate_weights(forms, step, over)
        assert val["e2e"] == pytest.approx(rep.summary.e2e_mean_s * 1e6, rel=1e-9)
        assert val["ttft"] == pytest.approx(rep.summary.ttft_mean_s * 1e6, rel=1e-9)
        assert val["itl"] == pytest.approx(rep.summary.itl_mean_s * 1e6, rel=1e-9)
        assert val["tpot"] == pytest.approx(rep.summary.tpot_mean_s * 1e6, rel=1e-9)
        for s, st in enumerate(rep.stages):
            assert val[f"stage_{s}/e2e"] == pytest.approx(st.e2e_mean_s * 1e6, rel=1e-9)
            assert val[f"stage_{s}/ttft"] == pytest.approx(st.ttft_mean_s * 1e6, rel=1e-9)


def test_weights_structure(runs):
    tr = runs[0].trajectory
    w, const = metric_weights(tr, stages=False)["e2e"]
    assert w.shape == (tr.n_steps,) and np.all(w >= -1e-12)
    # the weights count the steps on the mean request's path: at least its N tokens' steps,
    # at most wait + path + the output delay
    assert w.sum() == pytest.approx(const["scheduling_processing_us"])
    ok = tr.success
    longest = (tr.last_step[ok] - tr.wait_from_step[ok] + 3).max()
    assert tr.target_tokens[0] <= w.sum() <= longest
    # at low load (stage 0) the path is about N steps plus a couple
    w0, _ = metric_weights(tr)["stage_0/e2e"]
    assert tr.target_tokens[0] <= w0.sum() <= tr.target_tokens[0] + 4
    assert const["queueing_base_us"] == 1.0 and const["output_token_processing_us"] == 1.0
    assert const["queueing_per_input_token_us"] == pytest.approx(tr.input_len[tr.success].mean())
    # the load term enters with the mean number of requests in the step running at sending
    assert const["queueing_per_running_request_us"] == pytest.approx(tr.send_depth[tr.success].mean())
    assert tr.send_depth[tr.success].mean() > 1
    w_itl, c_itl = metric_weights(tr, stages=False)["itl"]
    # ITL is about half the per-token time: its weights sum to ~ (N - 1) / (2N - 1)
    n = tr.target_tokens[0]
    assert w_itl.sum() == pytest.approx((n - 1) / (2 * n - 1), rel=0.05)


def test_replay_is_teacher_forced(runs):
    tr = runs[0].trajectory
    slower = replay(tr, tr.step_time_us * 1.2, MODEL).summary
    base = replay(tr, tr.step_time_us, MODEL).summary
    assert slower.successes == base.successes  # same batches, same successes
    assert slower.e2e_mean_s > base.e2e_mean_s and slower.itl_mean_s > base.itl_mean_s


def test_replay_without_batch_rows(runs):
    tr = runs[1].trajectory
    slim = tr.without_batches()
    assert slim.batch_request.size == 0
    a = replay(slim, tr.step_time_us * 0.9, MODEL)
    b = replay(tr, tr.step_time_us * 0.9, MODEL)
    assert a == b


def test_a_fit_that_goes_negative_on_a_probe_step_is_rejected():
    """Replayed rows average blocks of steps; a probe is a single step that must get a time > 0."""
    from fitness.scoring import FitnessContext, fit_terms

    term = [lambda cols, n: cols["x"]]
    ok = fit_terms(term, FitnessContext(None, tiny_replay_rows([{"x": np.array([0.5, 4.0])}])))
    assert ok.ok and ok.coefficients[0] == pytest.approx(10.0)
    bad = fit_terms(term, FitnessContext(None, tiny_replay_rows([{"x": np.array([-1.0, 4.0])}])))
    assert not bad.ok
    assert fit_terms(term, FitnessContext(None, tiny_replay_rows(None))).ok  # rows without probes: no check


def test_probe_steps_cover_pure_prefill_and_the_extremes():
    from fitness.replay_rows import PROBE_SAMPLE, probe_steps

    n = 10_000
    decode = np.ones(n)
    decode[[17, 4_001]] = 0  # two pure-prefill steps
    kv = np.arange(n, dtype=float)
    kv[123] = -5.0
    idx = probe_steps({"decode_tokens": decode}, {"kv_tokens": kv})
    assert {17, 4_001, 123, n - 1} <= set(idx.tolist())
    assert len(idx) <= PROBE_SAMPLE + 4


def test_a_replay_fit_stores_every_non_step_term():
    """QueueingTime is fitted; the other non-step terms are stored too, at 0 (not fittable here)."""
    from fitness.scoring import FitnessContext, fit_terms
    from fitness.sim.latency_model import NON_STEP_NAMES

    got = fit_terms([lambda cols, n: cols["x"]], FitnessContext(None, tiny_replay_rows(None))).overheads
    assert set(got) == set(NON_STEP_NAMES)
    assert {
        "queueing_base_us",
        "output_token_processing_us",
        "scheduling_processing_us",
        "preemption_processing_us",
    } <= set(got)
    assert (
        got["output_token_processing_us"] == got["scheduling_processing_us"] == got["preemption_processing_us"] == 0.0
    )
