"""Percentiles as the load generator reports them: the arithmetic, hand-built event streams
(a request that times out, ITL pooled across requests), load stages, and the simulator."""

from __future__ import annotations

import numpy as np
import pytest
from test_sim_loadgen import _spec

from fitness.sim.engine import simulate
from fitness.sim.loadgen import (
    TokenTimes,
    client_times,
    lifecycle_metrics,
    metrics_from_event_streams,
    token_events_us,
)
from fitness.sim.models import ExpressionLatencyModel
from primitives.deployment import default_resolver
from primitives.distribution import PERCENTILE_KEYS, PERCENTILES, counted_percentiles, percentiles

GAP_US = 25.0


def test_counted_percentiles_are_numpys_on_the_expanded_sample():
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 300):
        values = rng.lognormal(size=n)
        counts = rng.integers(0, 5, size=n)
        counts[0] = max(counts[0], 1)  # never all zero
        expanded = np.repeat(values, counts)
        got = counted_percentiles(values, counts)
        assert list(got) == list(PERCENTILE_KEYS)
        assert np.allclose(list(got.values()), np.percentile(expanded, PERCENTILES), rtol=1e-12, atol=0)
        assert percentiles(expanded) == pytest.approx(got, rel=1e-12)
    # one value held a million times: no expansion needed
    assert set(counted_percentiles(np.array([25.0, 9e3]), np.array([10**6, 1])).values()) <= {25.0, 9e3}
    assert percentiles(np.zeros(0)) == {} and counted_percentiles(np.ones(2), np.zeros(2, int)) == {}
    assert PERCENTILE_KEYS[0] == "p0.1" and "p50" in PERCENTILE_KEYS and PERCENTILE_KEYS[-1] == "p99.9"


def hand_built():
    """Four requests of two stages; request 2 times out (its tokens came, slowly).

    Tokens arrive at different periods per request, so pooling the gaps differs from
    averaging per-request figures.
    """
    send = np.array([0.0, 1e5, 2e5, 3e5])
    periods = [10_000.0, 30_000.0, 200_000.0, 15_000.0]  # µs between tokens
    n_tok = [6, 4, 5, 9]
    tokens = [
        s + 40_000 * (i + 1) + p * np.arange(n) for i, (s, p, n) in enumerate(zip(send, periods, n_tok, strict=True))
    ]
    tokens[3][4:] += 50_000  # a stall in the middle of request 3
    success = np.array([True, True, False, True])
    stage = np.array([0, 0, 1, 1])
    # the engine's log: every token with its request, in arrival order
    req = np.concatenate([np.full(n, r) for r, n in enumerate(n_tok)])
    t = np.concatenate(tokens)
    order = np.argsort(t, kind="stable")
    log = TokenTimes.from_tokens(4, req[order], t[order], GAP_US)
    ct = client_times(
        send, np.array([x[0] for x in tokens]), np.array([x[-1] for x in tokens]), np.array(n_tok), GAP_US
    )
    return send, tokens, success, stage, log, ct


def reference(send, tokens, keep):
    """The load generator's arithmetic on the explicit event streams of the requests KEEP."""
    keep = list(keep)
    return metrics_from_event_streams(send[keep], [token_events_us(tokens[i], GAP_US) for i in keep])


def test_percentiles_match_the_event_streams_and_leave_out_the_timed_out_request():
    send, tokens, success, _, log, ct = hand_built()
    assert [list(log.times_us[log.offsets[r] : log.offsets[r + 1]]) for r in range(4)] == [list(x) for x in tokens]
    m = lifecycle_metrics(ct, success, tokens=log)
    ref = reference(send, tokens, [0, 1, 3])
    assert (m.successes, m.failures) == (3, 1)
    for metric, values in (("e2e", ref["e2e_us"]), ("ttft", ref["ttft_us"]), ("tpot", ref["tpot_us"])):
        expect = np.percentile(values, PERCENTILES) / 1e6
        assert list(m.distributions[metric].values()) == pytest.approx(list(expect), rel=1e-12)
    # ITL: every gap of the successful requests, pooled (2N - 1 per request)
    assert len(ref["itl_gaps_us"]) == sum(2 * len(tokens[i]) - 1 for i in (0, 1, 3))
    pooled = np.percentile(ref["itl_gaps_us"], PERCENTILES) / 1e6
    assert list(m.distributions["itl"].values()) == pytest.approx(list(pooled), rel=1e-12)
    assert m.stat_s("itl", "p50") == pytest.approx(GAP_US / 1e6)  # most gaps are the event gap
    assert m.stat_s("itl", "p99") < 0.1  # the timed-out request's 200 ms gaps are not in it
    per_request = np.mean([np.percentile(reference(send, tokens, [i])["itl_gaps_us"], 90) for i in (0, 1, 3)])
    assert m.stat_s("itl", "p90") != pytest.approx(per_request / 1e6, rel=0.01)  # pooled, not averaged
    assert m.stat_s("e2e", "mean") == m.e2e_mean_s == pytest.approx(ref["e2e_us"].mean() / 1e6)


def test_stage_percentiles_are_those_of_the_stage_alone():
    send, tokens, success, stage, log, ct = hand_built()
    s0 = lifecycle_metrics(ct, success, stage == 0, log)
    s1 = lifecycle_metrics(ct, success, stage == 1, log)
    assert (s0.successes, s0.failures, s1.successes, s1.failures) == (2, 0, 1, 1)
    for got, keep in ((s0, [0, 1]), (s1, [3])):
        ref = reference(send, tokens, keep)
        assert got.distributions["itl"] == pytest.approx(
            dict(zip(PERCENTILE_KEYS, np.percentile(ref["itl_gaps_us"], PERCENTILES) / 1e6, strict=True))
        )
        assert got.stat_s("ttft", "p90") == pytest.approx(np.percentile(ref["ttft_us"], 90) / 1e6)
    # a stage with no successful request has no percentiles (as the files have none)
    none = lifecycle_metrics(ct, success, np.array([False, False, True, False]), log)
    assert none.successes == 0 and none.distributions == {} and none.stat_s("e2e", "p99") is None


def test_tokens_delivered_together_give_a_zero_gap_not_a_negative_one():
    log = TokenTimes.from_tokens(1, np.zeros(3, int), np.array([1000.0, 1000.0, 9000.0]), GAP_US)
    ct = client_times(np.zeros(1), np.array([1000.0]), np.array([9000.0]), np.array([3]), GAP_US)
    itl = lifecycle_metrics(ct, np.ones(1, bool), tokens=log).distributions["itl"]
    # gaps 25, 0 (not -25), 25, 7975, 25: the lowest is 0, so p0.1 sits 0.4% of the way to 25 µs
    assert itl["p0.1"] == pytest.approx(0.004 * GAP_US / 1e6) and min(itl.values()) >= 0.0


def test_simulator_percentiles_follow_its_requests_and_leave_the_means_alone():
    shape = dict(num_groups=2, num_prompts_per_group=3, system_prompt_len=100, question_len=300, output_len=30)
    spec = _spec(stages=((2.0, 10.0), (8.0, 10.0)), request_timeout_s=1.15, **shape)  # stage 1 loses some requests
    dep = default_resolver().resolve(spec.model, spec.tp)
    model = ExpressionLatencyModel("30000.0 + 1.1*weight_time_us + 200.0*batch_size", dep, {"queueing_base_us": 8000.0})
    plain = simulate(spec, dep, model, record=False)
    full = simulate(spec, dep, model, record=False, distributions=True)
    assert plain.metrics.summary == full.metrics.summary and plain.metrics.stages == full.metrics.stages
    assert plain.metrics.summary.distributions == {} and "token_times" not in plain.extra
    req, ok = full.requests, full.requests.success
    assert 0 < (~ok).sum() < len(ok)  # a run with timeouts
    summary = full.metrics.summary
    assert summary.stat_s("e2e", "p90") == pytest.approx(np.percentile(req.e2e_us[ok], 90) / 1e6, rel=1e-12)
    for s, stage in enumerate(full.metrics.stages):
        sel = ok & (req.stage == s)
        assert stage.stat_s("ttft", "p99") == pytest.approx(np.percentile(req.ttft_us[sel], 99) / 1e6, rel=1e-12)
    # ITL against explicit event streams built from every token's arrival
    log = full.extra["token_times"]
    kept = np.flatnonzero(ok)
    streams = [token_events_us(log.times_us[log.offsets[r] : log.offsets[r + 1]], model.event_gap_us) for r in kept]
    assert all(len(s) == 2 * spec.output_len for s in streams)
    ref = metrics_from_event_streams(req.send_us[kept], streams)
    assert summary.distributions["itl"] == pytest.approx(
        dict(zip(PERCENTILE_KEYS, np.percentile(np.maximum(ref["itl_gaps_us"], 0), PERCENTILES) / 1e6, strict=True)),
        rel=1e-9,
    )
    assert ref["e2e_us"] == pytest.approx(req.e2e_us[kept])
