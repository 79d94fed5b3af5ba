"""The load generator: arrivals, prompt shapes, and the client's measurement arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from fitness.sim.loadgen import (
    PROMPT_INFLATION,
    PROMPT_SPREAD,
    build_load,
    client_times,
    lifecycle_metrics,
    metrics_from_event_streams,
    prompt_shapes,
    stage_offsets_s,
    token_events_us,
)
from primitives.data.experiments import ExperimentSpec


def _spec(**kw) -> ExperimentSpec:
    base = dict(
        name="t-general",
        model="meta-llama/Llama-2-7b-hf",
        tp=1,
        stages=((8.0, 600.0), (20.0, 600.0)),
        num_groups=10,
        num_prompts_per_group=10,
        system_prompt_len=100,
        question_len=447,
        output_len=248,
    )
    base.update(kw)
    return ExperimentSpec(**base)


# --- arrivals ------------------------------------------------------------------


@pytest.mark.parametrize("rate,duration", [(8.0, 600.0), (20.0, 600.0), (6.0, 1200.0), (2.5, 3.3), (0.1, 5.0)])
def test_arrival_count_and_span(rate, duration):
    t = stage_offsets_s(rate, duration, np.random.default_rng(1))
    assert len(t) == int(rate * duration)
    if len(t):
        assert np.all(np.diff(t) > 0) and t[0] > 0
        assert t[-1] == pytest.approx(duration, rel=1e-12)  # rescaled to span exactly the stage


def test_arrival_gaps_are_exponential():
    t = stage_offsets_s(20.0, 600.0, np.random.default_rng(7))
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # CV of an exponential
    assert stats.kstest(gaps / gaps.mean(), "expon").pvalue > 0.01
    u = stage_offsets_s(20.0, 600.0, None, process="uniform")
    assert np.allclose(np.diff(u), 1 / 20.0)


def test_load_plan_is_seeded_and_round_robin():
    spec = _spec()
    a, b, c = build_load(spec, 3), build_load(spec, 3), build_load(spec, 4)
    assert all(np.array_equal(x, y) for x, y in zip(a.stage_offsets_s, b.stage_offsets_s, strict=True))
    assert np.array_equal(a.shapes.user_prompt_len, b.shapes.user_prompt_len)
    assert not np.array_equal(a.stage_offsets_s[0], c.stage_offsets_s[0])
    assert a.num_requests == 4800 + 12000
    assert np.array_equal(a.request_user, np.arange(a.num_requests) % 100)
    assert np.array_equal(np.bincount(a.request_stage), [4800, 12000])
    assert list(a.stage_first_request) == [0, 4800, 16800]


# --- prompts -------------------------------------------------------------------


@pytest.mark.parametrize("sys_len,q_len", [(100, 447), (100, 466), (150, 600)])
def test_prompt_inflation(sys_len, q_len):
    spec = _spec(system_prompt_len=sys_len, question_len=q_len)
    sh = prompt_shapes(spec, np.random.default_rng(0))
    ratio = sh.user_prompt_len / (sys_len + q_len)
    assert ratio.mean() == pytest.approx(PROMPT_INFLATION, abs=0.01)
    lo, hi = PROMPT_INFLATION * (1 - PROMPT_SPREAD), PROMPT_INFLATION * (1 + PROMPT_SPREAD)
    slack = 1.0 / (sys_len + q_len)  # rounding
    assert ratio.min() >= lo - slack and ratio.max() <= hi + slack
    assert ratio.max() - ratio.min() > 0.6 * (hi - lo)  # users do spread
    sys_ratio = sh.group_system_len / sys_len
    assert np.all((sys_ratio >= lo - 1 / sys_len) & (sys_ratio <= hi + 1 / sys_len))
    assert np.all(sh.user_prompt_len > sh.group_system_len[sh.user_group])
    assert np.array_equal(sh.user_group, np.repeat(np.arange(10), 10))


# --- measurement ---------------------------------------------------------------


def test_closed_form_matches_event_stream():
    rng = np.random.default_rng(0)
    sends, firsts, lasts, ns, streams = [], [], [], [], []
    for n in (1, 2, 5, 248):
        send = rng.uniform(0, 1e6)
        tok = send + 30_000 + np.cumsum(rng.uniform(5_000, 25_000, size=n))
        streams.append(token_events_us(tok, 25.0))
        sends.append(send), firsts.append(tok[0]), lasts.append(tok[-1]), ns.append(n)
    ref = metrics_from_event_streams(np.array(sends), streams)
    ct = client_times(np.array(sends), np.array(firsts), np.array(lasts), np.array(ns), 25.0)
    assert np.allclose(ct.e2e_us, ref["e2e_us"]) and np.allclose(ct.ttft_us, ref["ttft_us"])
    assert np.allclose(ct.tpot_us, ref["tpot_us"])
    assert ct.span_us.sum() / ct.gaps.sum() == pytest.approx(ref["itl_mean_us"])
    assert all(len(s) == 2 * n for s, n in zip(streams, ns, strict=True))


def test_itl_is_half_the_token_period():
    # one token per 20 ms: the pooled ITL is ~10 ms, its median a few µs (the NOTES §3 signature)
    tok = 1e5 + 20_000.0 * np.arange(248)
    ev = token_events_us(tok, 20.0)
    gaps = np.diff(ev)
    assert np.median(gaps) == pytest.approx(20.0)
    m = metrics_from_event_streams(np.array([0.0]), [ev])
    assert m["itl_mean_us"] == pytest.approx(10_000, rel=0.01)
    assert m["tpot_us"][0] == pytest.approx(m["itl_mean_us"])


def test_failures_are_excluded_from_means():
    send = np.zeros(4)
    ct = client_times(
        send, np.array([1e5, 2e5, 3e5, np.nan]), np.array([1e6, 2e6, 9e6, np.nan]), np.array([10, 10, 10, 10]), 0.0
    )
    ok = np.array([True, True, False, False])
    m = lifecycle_metrics(ct, ok)
    assert (m.successes, m.failures) == (2, 2)
    assert m.e2e_mean_s == pytest.approx(1.5) and m.ttft_mean_s == pytest.approx(0.15)
    stage = np.array([0, 1, 0, 1])
    m0 = lifecycle_metrics(ct, ok, stage == 0)
    assert (m0.successes, m0.failures) == (1, 1) and m0.e2e_mean_s == pytest.approx(1.0)
    none = lifecycle_metrics(ct, np.zeros(4, bool))
    assert none.successes == 0 and none.e2e_mean_s is None
