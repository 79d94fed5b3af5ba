"""The inference-perf load generator (shared-prefix data, constant-rate stages) and its client.

What the real runs did (``../shared/NOTES.md`` §2-3):

* **Arrivals.** Per stage ``int(rate * duration)`` requests; exponential gaps rescaled so
  that the last request is sent exactly ``duration`` after the stage starts (the first one
  a fraction of a gap in: the results' ``send_duration`` is ``duration`` minus about one
  mean gap). A stage starts once the previous one has drained (every response received
  or timed out), after ``load.interval``.
* **Prompts.** ``num_groups`` system prompts, ``num_prompts_per_group`` questions each;
  user ``u`` belongs to group ``u // num_prompts_per_group`` and request ``i`` goes to user
  ``i mod users``. A user always sends the same prompt (the results' prompt lengths do not
  grow), so prefix caching reuses the group's system prompt and, after the first round,
  the user's whole prompt. Prompts of random token ids re-tokenise to more tokens than
  configured: measured ``prompt_len`` mean/configured is 575/547, 593.5/566 and 786/750
  (x1.05), with users spread about ±2.7 % (general: 559..589).
* **Output.** ``max_tokens = output_len`` with ``ignore_eos``: exactly ``output_len`` tokens.
* **Timeout.** The HTTP client gives up ``request_timeout_s`` after sending; such requests
  are failures, kept out of the latency statistics.
* **Measurement** (client side, from the streamed events). Each generated token arrives
  as *two* events ``event_gap_us`` apart. E2E = send -> last event; TTFT = send -> first
  event; ITL = every gap between consecutive events, pooled over requests; TPOT =
  (last - first event) / (events after the first). So ITL and TPOT are about half the
  per-token time.
* **Percentiles** (only when asked: :class:`TokenTimes`, :func:`client_distributions`):
  those of the lifecycle files, over the successful requests; ITL's over every gap of
  those requests pooled: per request, ``N`` event gaps and the ``N - 1`` gaps from a token's
  second event to the next token's first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from primitives.data.experiments import EXP_CONFIG, PROFILE, RESULTS_CONFIG, ExperimentSpec, LifecycleMetrics
from primitives.distribution import counted_percentiles, percentiles
from primitives.errors import InputError

# Re-tokenisation of random-token prompts: mean inflation and per-user spread (uniform ±).
PROMPT_INFLATION = 1.05
PROMPT_SPREAD = 0.027
EVENTS_PER_TOKEN = 2
# Gap between the two events of a token. The ITL percentiles show it: p10 9 µs, p25 22 µs,
# median 38 µs (the median sits at the edge between the short and the step-long gaps).
DEFAULT_EVENT_GAP_US = 25.0
US_PER_S = 1e6


@dataclass(frozen=True)
class PromptShapes:
    """Re-tokenised prompt lengths, fixed per user (deterministic from the seed)."""

    group_system_len: np.ndarray  # tokens of each group's system prompt (the shared prefix)
    user_group: np.ndarray  # group of each user
    user_prompt_len: np.ndarray  # whole prompt (system + question) of each user

    @property
    def num_users(self) -> int:
        return len(self.user_group)


@dataclass(frozen=True)
class LoadPlan:
    """Every request of an experiment, before any timing: who sends what, in which stage.

    Send times are per-stage offsets because a stage starts only when the previous one
    has drained, which the closed loop decides.
    """

    shapes: PromptShapes
    output_len: int
    request_user: np.ndarray  # int, user of each request (request i -> i mod users)
    request_stage: np.ndarray  # int, stage of each request
    stage_offsets_s: tuple[np.ndarray, ...]  # per stage: send time after the stage start (s)
    stage_first_request: np.ndarray  # index of each stage's first request; last entry = total
    timeout_s: float
    stage_interval_s: float

    @property
    def num_requests(self) -> int:
        return len(self.request_user)

    @property
    def request_input_len(self) -> np.ndarray:
        return self.shapes.user_prompt_len[self.request_user]

    @property
    def request_group(self) -> np.ndarray:
        return self.shapes.user_group[self.request_user]


def _inflated(configured: int, n: int, rng: np.random.Generator) -> np.ndarray:
    factor = PROMPT_INFLATION * (1.0 + rng.uniform(-PROMPT_SPREAD, PROMPT_SPREAD, size=n))
    return np.maximum(np.rint(configured * factor).astype(np.int64), 0)


def prompt_shapes(spec: ExperimentSpec, rng: np.random.Generator) -> PromptShapes:
    """Per-group system prompt and per-user prompt lengths after re-tokenisation."""
    groups, per_group = spec.num_groups, spec.num_prompts_per_group
    system = _inflated(spec.system_prompt_len, groups, rng)
    total = _inflated(spec.system_prompt_len + spec.question_len, groups * per_group, rng)
    user_group = np.repeat(np.arange(groups, dtype=np.int64), per_group)
    # every prompt holds its group's whole system prompt and at least one question token
    total = np.maximum(total, system[user_group] + (1 if spec.question_len > 0 else 0))
    total = np.maximum(total, 1)
    return PromptShapes(group_system_len=system, user_group=user_group, user_prompt_len=total)


def stage_offsets_s(
    rate: float, duration_s: float, rng: np.random.Generator, process: str = "exponential"
) -> np.ndarray:
    """Send times of one stage after its start (s): ``int(rate*duration)`` of them.

    ``exponential``: exponential gaps rescaled so the cumulative sum ends exactly at
    ``duration_s``; ``uniform``: evenly spaced, the last at ``duration_s``.
    """
    n = int(rate * duration_s)
    if n <= 0:
        return np.zeros(0)
    if process == "uniform":
        return np.arange(1, n + 1, dtype=np.float64) * (duration_s / n)
    if process != "exponential":
        raise ValueError(f"unknown arrival process {process!r}")
    gaps = rng.exponential(1.0, size=n)
    t = np.cumsum(gaps)
    return t * (duration_s / t[-1])


def build_load(spec: ExperimentSpec, seed: int = 0, process: str = "exponential") -> LoadPlan:
    """The requests of an experiment: users, stages, per-stage send offsets (seeded)."""
    seq = np.random.SeedSequence(seed)
    prompt_seq, arrival_seq = seq.spawn(2)
    shapes = prompt_shapes(spec, np.random.default_rng(prompt_seq))
    stage_rngs = [np.random.default_rng(s) for s in arrival_seq.spawn(len(spec.stages))]
    offsets = tuple(
        stage_offsets_s(rate, dur, rng, process) for (rate, dur), rng in zip(spec.stages, stage_rngs, strict=True)
    )
    counts = np.array([len(o) for o in offsets], dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    total = int(first[-1])
    users = max(shapes.num_users, 1)
    return LoadPlan(
        shapes=shapes,
        output_len=int(spec.output_len),
        request_user=np.arange(total, dtype=np.int64) % users,
        request_stage=np.repeat(np.arange(len(counts), dtype=np.int64), counts),
        stage_offsets_s=offsets,
        stage_first_request=first,
        timeout_s=float(spec.request_timeout_s),
        stage_interval_s=float(spec.stage_interval_s),
    )


def no_success_reason(spec: ExperimentSpec, deployment, load: LoadPlan | None = None) -> tuple[str, str] | None:
    """(field, why) when the inputs let no request of SPEC succeed whatever the step time; else None.

    The limits the engine enforces: a request longer than ``max_model_len`` is rejected at
    once, one that can never fit the KV cache is rejected at the queue head.
    """
    load = build_load(spec) if load is None else load
    if load.num_requests == 0:
        return "load.stages", "no stage sends a request (rate x duration < 1 in every stage)"
    shortest = int((load.request_input_len + load.output_len).min())
    if shortest > spec.max_model_len:
        return "max_model_len", (
            f"max_model_len {spec.max_model_len} is below the shortest request ({shortest} tokens of prompt and output)"
        )
    kv_tokens = deployment.kv_capacity_tokens(spec.gpu_memory_utilization)
    if kv_tokens < shortest:
        usable_gb = spec.gpu_memory_utilization * deployment.gpu.memory_bytes / 1e9
        return "gpu_memory_utilization", (
            f"the KV cache holds {kv_tokens} tokens per GPU (gpu_memory_utilization {spec.gpu_memory_utilization:g} "
            f"of {deployment.gpu.memory_bytes / 1e9:.0f} GB = {usable_gb:.1f} GB, weights "
            f"{deployment.weight_bytes_per_gpu / 1e9:.1f} GB per GPU at TP{deployment.tp}); "
            f"the shortest request needs {shortest}"
        )
    return None


class NoSuccessfulRequest(InputError):
    """A simulation that served no request successfully: nothing to measure latencies on."""


def _config_path(spec: ExperimentSpec, field: str) -> object:
    """The file of SPEC that sets FIELD: the server's exp-config.yaml, or the load generator's."""
    if not spec.path:
        return spec.name
    if not field.startswith("load."):
        return Path(spec.path) / EXP_CONFIG
    resolved = Path(spec.path) / RESULTS_CONFIG
    return resolved if resolved.exists() else Path(spec.path) / PROFILE


def check_servable(spec: ExperimentSpec, deployment) -> None:
    """Raise :class:`NoSuccessfulRequest` naming the limit when the inputs let no request succeed."""
    reason = no_success_reason(spec, deployment)
    if reason is not None:
        field, why = reason
        raise NoSuccessfulRequest(
            _config_path(spec, field), field, f"experiment {spec.name!r}: no request can succeed: {why}"
        )


def require_success(spec: ExperimentSpec, deployment, metrics: LifecycleMetrics, what: str) -> None:
    """Raise :class:`NoSuccessfulRequest` when METRICS count no success: the limit to blame, else
    WHAT (the model) timing out."""
    if metrics.successes > 0:
        return
    check_servable(spec, deployment)
    raise NoSuccessfulRequest(
        _config_path(spec, "load.request_timeout"),
        "load.request_timeout",
        f"experiment {spec.name!r}: {what} serves none of {metrics.failures} requests within the "
        f"{spec.request_timeout_s:g} s timeout",
    )


# ---------------------------------------------------------------------------
# Client-side measurement


def token_events_us(token_times_us: np.ndarray, event_gap_us: float = DEFAULT_EVENT_GAP_US) -> np.ndarray:
    """The streamed events of one request: two per token, ``event_gap_us`` apart."""
    t = np.asarray(token_times_us, dtype=np.float64)
    return np.stack([t, t + event_gap_us], axis=1).ravel()


def metrics_from_event_streams(send_us: np.ndarray, streams: list[np.ndarray]) -> dict[str, np.ndarray | float]:
    """The load generator's arithmetic on explicit event streams (reference, for tests).

    Returns per-request ``e2e_us``, ``ttft_us``, ``tpot_us``, the pooled ``itl_mean_us`` and
    every pooled gap, ``itl_gaps_us``.
    """
    e2e, ttft, tpot, gaps = [], [], [], []
    for s, ev in zip(send_us, streams, strict=True):
        ev = np.asarray(ev, dtype=np.float64)
        e2e.append(ev[-1] - s)
        ttft.append(ev[0] - s)
        tpot.append((ev[-1] - ev[0]) / (len(ev) - 1) if len(ev) > 1 else 0.0)
        gaps.append(np.diff(ev))
    pooled = np.concatenate(gaps) if gaps else np.zeros(0)
    return {
        "e2e_us": np.array(e2e),
        "ttft_us": np.array(ttft),
        "tpot_us": np.array(tpot),
        "itl_mean_us": float(pooled.mean()) if len(pooled) else float("nan"),
        "itl_gaps_us": pooled,
    }


@dataclass(frozen=True)
class ClientTimes:
    """Per-request client measurements (µs), from first/last token arrival times."""

    e2e_us: np.ndarray
    ttft_us: np.ndarray
    span_us: np.ndarray  # last event - first event
    gaps: np.ndarray  # events after the first (= number of ITL gaps): 2 * tokens - 1
    tpot_us: np.ndarray


def client_times(
    send_us: np.ndarray,
    first_token_us: np.ndarray,
    last_token_us: np.ndarray,
    n_tokens: np.ndarray,
    event_gap_us: float = DEFAULT_EVENT_GAP_US,
) -> ClientTimes:
    """Closed form of :func:`metrics_from_event_streams` for two events per token.

    Only the first and the last token times matter: the events of token m are at
    ``t_m`` and ``t_m + gap``, so the last event is ``t_N + gap`` and the pooled ITL gaps of a
    request sum to ``t_N + gap - t_1`` over ``2N - 1`` gaps.
    """
    n_tokens = np.asarray(n_tokens, dtype=np.float64)
    last_event = last_token_us + event_gap_us
    span = last_event - first_token_us
    gaps = EVENTS_PER_TOKEN * n_tokens - 1
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(gaps > 0, span / np.maximum(gaps, 1), 0.0)
    return ClientTimes(
        e2e_us=last_event - send_us,
        ttft_us=first_token_us - send_us,
        span_us=span,
        gaps=gaps,
        tpot_us=tpot,
    )


@dataclass(frozen=True)
class TokenTimes:
    """When every token of every request reached the client (µs), request by request, and the
    client's event gap: token m of request r is ``times_us[offsets[r] + m]``."""

    offsets: np.ndarray  # n_requests + 1
    times_us: np.ndarray
    event_gap_us: float

    @classmethod
    def from_tokens(cls, n_requests: int, request: np.ndarray, time_us: np.ndarray, event_gap_us: float):
        """From every token's request and arrival time, listed in arrival order."""
        request = np.asarray(request, dtype=np.int64)
        order = np.argsort(request, kind="stable")  # a request's tokens stay in arrival order
        offsets = np.concatenate([[0], np.cumsum(np.bincount(request, minlength=n_requests))])
        return cls(offsets.astype(np.int64), np.asarray(time_us, dtype=np.float64)[order], float(event_gap_us))


def client_distributions(times: ClientTimes, tokens: TokenTimes, sel: np.ndarray) -> dict[str, dict[str, float]]:
    """Percentiles (s) of E2E, TTFT and TPOT over the requests SEL (a mask), of ITL over their pooled gaps.

    Token m's events are at ``t_m`` and ``t_m + gap``: a request's gaps are ``gap`` once per
    token and ``t_(m+1) - t_m - gap`` between tokens (never below 0: two tokens the engine
    delivers at once, at the end of a request before an idle engine, give 0).
    """
    sel = np.asarray(sel, dtype=bool)
    out = {m: percentiles(getattr(times, f"{m}_us")[sel] / US_PER_S) for m in ("e2e", "ttft", "tpot")}
    counts = np.diff(tokens.offsets)
    on = np.repeat(sel, counts)  # tokens of the selected requests
    first = np.zeros(len(on), dtype=bool)
    first[tokens.offsets[:-1][counts > 0]] = True
    pair = on[:-1] & ~first[1:]  # tokens j and j + 1 belong to one selected request
    g = tokens.event_gap_us
    between = np.maximum(np.diff(tokens.times_us)[pair] - g, 0.0)
    out["itl"] = counted_percentiles(
        np.append(between, g) / US_PER_S, np.append(np.ones(len(between), np.int64), counts[sel].sum())
    )
    return {m: v for m, v in out.items() if v}


def lifecycle_metrics(
    times: ClientTimes, success: np.ndarray, mask: np.ndarray | None = None, tokens: TokenTimes | None = None
) -> LifecycleMetrics:
    """Means (s) over the successful requests in MASK, as the results files report them; their
    percentiles too when every token's arrival is given (TOKENS)."""
    success = np.asarray(success, dtype=bool)
    sel = success if mask is None else success & mask
    n_fail = int(((~success) if mask is None else (~success & mask)).sum())
    means = lifecycle_means(times, sel, n_fail)
    if tokens is None or not sel.any():
        return means
    return replace(means, distributions=client_distributions(times, tokens, sel))


def lifecycle_means(times, sel, failures: int) -> LifecycleMetrics:
    """Means (s) over the requests SEL (a mask or slice) of TIMES, with FAILURES failed requests.

    TIMES: anything with per-request ``e2e_us``, ``ttft_us``, ``span_us``, ``gaps`` and
    ``tpot_us`` (:class:`ClientTimes`, ``fitness.sim.replay.ReplayTimes``). ITL pools every gap.
    """
    e2e = times.e2e_us[sel]
    n_ok = len(e2e)
    if n_ok == 0:
        return LifecycleMetrics(successes=0, failures=failures)
    gaps = times.gaps[sel].sum()
    return LifecycleMetrics(
        successes=n_ok,
        failures=failures,
        e2e_mean_s=float(e2e.mean() / US_PER_S),
        ttft_mean_s=float(times.ttft_us[sel].mean() / US_PER_S),
        itl_mean_s=float(times.span_us[sel].sum() / gaps / US_PER_S) if gaps > 0 else None,
        tpot_mean_s=float(times.tpot_us[sel].mean() / US_PER_S),
    )
