"""An archived model as a LatencyModel the simulator can drive.

The step time is the archived sympy expression evaluated on the batch's primitives
(``primitives.compute``), floored at 1 µs as BLIS's StepTime is. The non-step terms
(all µs) are the ones stored with the entry; their meaning:

* ``queueing_base_us`` + ``queueing_per_input_token_us`` * input length: QueueingTime,
  arrival at the server -> enqueued at the scheduler (HTTP, tokenisation).
* ``output_token_processing_us``: OutputTokenProcessingTime, engine emits a token ->
  the client receives its event (shifts every event of a request).
* ``scheduling_processing_us``: SchedulingProcessingTime, added to every step's cycle.
* ``preemption_processing_us``: PreemptionProcessingTime, added per preemption.
* ``post_decode_fixed_us``: BLIS's PostDecodeFixedOverhead, after a request's last token.
"""
from __future__ import annotations

import numpy as np
import sympy as sp

from primitives.language import SCALAR_MODULES, parse_infix, symbol
from primitives.compute import BatchPrimitives
from primitives.deployment import Deployment

DEFAULT_OVERHEADS: dict[str, float] = {
    "queueing_base_us": 0.0,
    "queueing_per_input_token_us": 0.0,
    "output_token_processing_us": 0.0,
    "scheduling_processing_us": 0.0,
    "preemption_processing_us": 0.0,
    "post_decode_fixed_us": 0.0,
}


def full_overheads(fitted: dict[str, float] | None) -> dict[str, float]:
    out = dict(DEFAULT_OVERHEADS)
    out.update(fitted or {})
    return out


class ExpressionLatencyModel:
    """Duck-typed LatencyModel (see fitness.sim.simulator) for one deployment."""

    def __init__(self, expr: sp.Expr | str, deployment: Deployment, overheads: dict[str, float] | None = None):
        if isinstance(expr, str):
            expr = parse_infix(expr)
        self.expr = expr
        self.names = sorted(s.name for s in expr.free_symbols)
        self._primitives = BatchPrimitives(deployment, self.names)
        self._scalar_fn = sp.lambdify([symbol(n) for n in self.names], expr, modules=SCALAR_MODULES)
        o = full_overheads(overheads)
        self.queueing_base_us = o["queueing_base_us"]
        self.queueing_per_input_token_us = o["queueing_per_input_token_us"]
        self.output_token_processing_us = o["output_token_processing_us"]
        self.scheduling_processing_us = o["scheduling_processing_us"]
        self.preemption_processing_us = o["preemption_processing_us"]
        self.post_decode_fixed_us = o["post_decode_fixed_us"]

    @classmethod
    def from_entry(cls, entry, deployment: Deployment) -> "ExpressionLatencyModel":
        return cls(entry.expression, deployment, entry.overheads)

    def step_time_us(self, progress, new_tokens, input_len, output_len) -> float:
        vals = self._primitives.scalars(progress, new_tokens, input_len, output_len)
        try:
            value = float(self._scalar_fn(*[vals[n] for n in self.names]))
        except (ZeroDivisionError, OverflowError, ValueError):
            value = float("nan")
        return value if value > 1.0 else 1.0  # floor at 1 µs; NaN also becomes 1 µs

    def queueing_time_us(self, input_len) -> np.ndarray:
        return self.queueing_base_us + self.queueing_per_input_token_us * np.asarray(input_len, dtype=float)
