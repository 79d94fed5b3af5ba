"""The latency-model seam: what the simulator, replay and the Go export ask of a model.

Contract (all times in µs, the units of BLIS's ``sim.LatencyModel``):

* ``step_time_us(progress, new_tokens, input_len, output_len) -> float``: the cycle time
  of one scheduler step over the batch's per-request fields (BLIS's ``ProgressIndex``,
  ``NumNewTokens``, ``len(InputTokens)``, ``len(OutputTokens)`` so far). It is at least
  1 µs, also for an empty batch, and never NaN (BLIS's ``StepTime`` contract).
* the seven **non-step terms** below, defined once here with the BLIS (or seed-interface)
  method each becomes: the archive stores them by ``name``, the simulator and replay read
  them as attributes, and ``translate_go`` prints them under ``go_name``;
* ``queueing_time_us(input_len, running=0)``: QueueingTime of each request, from the three
  queueing terms. The third, ``queueing_per_running_request_us``, counts the ``running``
  requests of the step running when it arrives (the clients' median TTFT grows with them;
  likely the API server, which streams their tokens on the asyncio loop that takes new
  requests in). The simulator adds it when a request is sent (the rest is known before),
  the replay from the recorded count, and the Go model remembers its last batch;
* ``event_gap_us``: not a latency term but the client's measurement, the gap between the two
  streamed events of a token (the simulator measures with the model's, so a test can set it).

Every model has every attribute (no defaults are looked up): inheriting :class:`NonStepTerms`
gives them all, at 0 µs (BLIS's default) and ``DEFAULT_EVENT_GAP_US``.
"""

from __future__ import annotations

from dataclasses import dataclass, make_dataclass
from typing import Protocol

import numpy as np

from fitness.sim.loadgen import DEFAULT_EVENT_GAP_US

MIN_STEP_TIME_US = 1.0  # BLIS's StepTime returns at least 1 µs


@dataclass(frozen=True)
class NonStepTerm:
    """One non-step latency term (µs)."""

    name: str  # key in an archive entry's overheads and attribute of a latency model
    method: str  # the Go method that returns it (BLIS's, or the seed interface's)
    go_name: str  # the Go constant that holds it
    doc: str  # what it is, one line


NON_STEP_TERMS: tuple[NonStepTerm, ...] = (
    NonStepTerm("queueing_base_us", "QueueingTime", "queueingBaseUs", "QueueingTime: arrival -> enqueued, fixed part"),
    NonStepTerm(
        "queueing_per_input_token_us",
        "QueueingTime",
        "queueingPerInputTokenUs",
        "QueueingTime: per prompt token (tokenisation)",
    ),
    NonStepTerm(
        "queueing_per_running_request_us",
        "QueueingTime",
        "queueingPerRunningRequestUs",
        "QueueingTime: per request in the step running at arrival",
    ),
    NonStepTerm(
        "output_token_processing_us",
        "OutputTokenProcessingTime",
        "outputTokenProcessingUs",
        "OutputTokenProcessingTime: token emitted -> client event",
    ),
    NonStepTerm(
        "scheduling_processing_us",
        "SchedulingProcessingTime",
        "schedulingProcessingUs",
        "SchedulingProcessingTime: added to every step",
    ),
    NonStepTerm(
        "preemption_processing_us",
        "PreemptionProcessingTime",
        "preemptionProcessingUs",
        "PreemptionProcessingTime: per preemption",
    ),
    NonStepTerm(
        "post_decode_fixed_us",
        "PostDecodeFixedOverhead",
        "postDecodeFixedUs",
        "PostDecodeFixedOverhead: after a request's last token",
    ),
)
NON_STEP_NAMES: tuple[str, ...] = tuple(t.name for t in NON_STEP_TERMS)
NON_STEP_BY_NAME: dict[str, NonStepTerm] = {t.name: t for t in NON_STEP_TERMS}
# the terms a replay fit solves for (the others cannot be told apart in client metrics)
FITTED_NON_STEP_NAMES: tuple[str, ...] = (
    "queueing_base_us",
    "queueing_per_input_token_us",
    "queueing_per_running_request_us",
)
# the terms the simulated server applies (PostDecodeFixedOverhead is BLIS's alone)
SIMULATED_NON_STEP_NAMES: tuple[str, ...] = tuple(n for n in NON_STEP_NAMES if n != "post_decode_fixed_us")


def full_non_step_terms(given: dict[str, float] | None) -> dict[str, float]:
    """Every non-step term, the ones not GIVEN at 0 µs (BLIS's default)."""
    out = dict.fromkeys(NON_STEP_NAMES, 0.0)
    out.update(given or {})
    return out


def queueing_time_us(
    base_us: float, per_input_token_us: float, input_len, per_running_request_us: float = 0.0, running=0
) -> np.ndarray:
    """QueueingTime(req) = base + per-token × prompt length + per-request × requests in the
    step running at arrival: arrival -> enqueued (HTTP, tokenisation, the server's load)."""
    out = base_us + per_input_token_us * np.asarray(input_len, dtype=np.float64)
    return out + per_running_request_us * np.asarray(running, dtype=np.float64)


def _queueing_time_us(self, input_len, running=0) -> np.ndarray:
    return queueing_time_us(
        self.queueing_base_us,
        self.queueing_per_input_token_us,
        input_len,
        self.queueing_per_running_request_us,
        running,
    )


# The base of the latency models: a dataclass with one float field per non-step term (from
# the table above), the client's event gap, and queueing_time_us.
NonStepTerms = make_dataclass(
    "NonStepTerms",
    [(t.name, float, 0.0) for t in NON_STEP_TERMS] + [("event_gap_us", float, DEFAULT_EVENT_GAP_US)],
    namespace={
        "queueing_time_us": _queueing_time_us,
        "__module__": __name__,
        "__doc__": "The non-step terms of a latency model (µs, 0 unless given) and the client's event gap.",
    },
    eq=False,  # a model that is not itself a dataclass compares by identity
)


class LatencyModel(Protocol):
    """What the simulator asks of a step-time model (all times in µs)."""

    queueing_base_us: float
    queueing_per_input_token_us: float
    queueing_per_running_request_us: float  # per request of the step running at arrival
    output_token_processing_us: float  # engine emits a token -> client receives it
    scheduling_processing_us: float  # added to every step's cycle
    preemption_processing_us: float  # added to a step's cycle per preemption
    post_decode_fixed_us: float  # BLIS only: after a request's last token
    event_gap_us: float  # client measurement: between the two events of a token

    def step_time_us(
        self, progress: np.ndarray, new_tokens: np.ndarray, input_len: np.ndarray, output_len: np.ndarray
    ) -> float:
        """At least MIN_STEP_TIME_US, also for an empty batch; never NaN."""
        ...

    def queueing_time_us(self, input_len: np.ndarray, running=0) -> np.ndarray: ...
