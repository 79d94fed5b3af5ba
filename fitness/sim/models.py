"""The latency models the simulator can drive, behind a small registry (``make_model``).

* ``expression``: an archived model, its sympy expression evaluated on the batch's
  primitives (``primitives.compute``), floored at 1 µs as BLIS's StepTime is, with the
  non-step terms stored with the entry.
* ``physics``: a hand-made roofline-ish model over the deployment constants (reference).
* ``anchored``: another model with its step times scaled by a constant (recording only).

The expression and physics models inherit :class:`fitness.sim.latency_model.NonStepTerms`,
so they have every non-step term (0 µs unless given) and the client's event gap; an
anchored model has the ones of the model it wraps.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from fitness.sim.latency_model import NON_STEP_NAMES, LatencyModel, NonStepTerms, full_non_step_terms
from primitives.compute import BatchPrimitives
from primitives.deployment import Deployment
from primitives.language import SCALAR_MODULES, parse_infix, symbol
from primitives.program import StepProgram, Unsupported, step_program


class ExpressionLatencyModel(NonStepTerms):
    """An archived model (expression + non-step terms) for one deployment."""

    def __init__(self, expr: sp.Expr | str, deployment: Deployment, overheads: dict[str, float] | None = None):
        if isinstance(expr, str):
            expr = parse_infix(expr)
        self.expr = expr
        self.names = sorted(s.name for s in expr.free_symbols)
        self._primitives = BatchPrimitives(deployment, self.names)
        self._scalar_fn = sp.lambdify([symbol(n) for n in self.names], expr, modules=SCALAR_MODULES)
        o = full_non_step_terms(overheads)
        super().__init__(**{n: o[n] for n in NON_STEP_NAMES})

    @classmethod
    def from_entry(cls, entry, deployment: Deployment) -> "ExpressionLatencyModel":
        return cls(entry.expression, deployment, entry.overheads)

    def step_program(self) -> StepProgram:
        """This model as data for the compiled simulator core (same bits as ``step_time_us``)."""
        p = self._primitives
        return step_program(p.constants, p.kernel_functions, self.names, self._scalar_fn)

    def step_time_us(self, progress, new_tokens, input_len, output_len) -> float:
        vals = self._primitives.scalars(progress, new_tokens, input_len, output_len)
        try:
            value = float(self._scalar_fn(*[vals[n] for n in self.names]))
        except (ZeroDivisionError, OverflowError, ValueError):
            value = float("nan")
        return value if value > 1.0 else 1.0  # floor at 1 µs; NaN also becomes 1 µs


@dataclass
class PhysicsLatencyModel(NonStepTerms):
    """A hand-made roofline-ish step-time model over the deployment constants (reference).

    ``step_time_us = dense + kv_coef * kv_io_time + attention_coef * attention_time +
    per_layer_us * n_layers + allreduce_latency_us * allreduce_calls + per_request_us *
    batch_size + base_us`` with ``dense = max(weight_coef * weight_time, matmul_coef *
    matmul_time)`` (a roofline: streaming the weights or the matmul FLOPs, whichever is
    longer) or their sum when ``roofline`` is False; each ``*_time`` as in
    ``primitives.registry``. Vector sums only: cheap enough for the closed loop. There is no
    1 µs floor: the weights and layers alone take far longer.
    """

    deployment: Deployment | None = None
    weight_coef: float = 1.2
    kv_coef: float = 1.5
    matmul_coef: float = 0.0
    attention_coef: float = 0.0
    per_layer_us: float = 90.0
    allreduce_latency_us: float = 0.0  # per all-reduce launch (2 per layer at TP > 1)
    per_request_us: float = 0.0
    base_us: float = 0.0
    roofline: bool = True

    def __post_init__(self) -> None:
        if self.deployment is None:
            raise ValueError("PhysicsLatencyModel needs a deployment")
        c = self.deployment.constants
        self._weight_us = c["weight_bytes_per_gpu"] / c["hbm_bytes_per_us"]
        self._kv_us_per_token = c["kv_bytes_per_token_per_gpu"] / c["hbm_bytes_per_us"]
        self._matmul_us_per_token = 2.0 * c["active_params_per_gpu"] / c["dense_flops_per_us"]
        self._attn_us_per_pair = c["attn_flops_per_token_pair_per_gpu"] / c["dense_flops_per_us"]
        calls = 2.0 * c["n_layers"] if c["tp"] > 1 else 0.0
        self._weight_part_us = self.weight_coef * self._weight_us
        self._fixed_us = self.per_layer_us * c["n_layers"] + self.allreduce_latency_us * calls + self.base_us

    def step_time_us(self, progress, new_tokens, input_len, output_len) -> float:
        tokens = float(new_tokens.sum())
        kv = float(progress.sum()) + tokens
        matmul = self.matmul_coef * self._matmul_us_per_token * tokens
        dense = max(self._weight_part_us, matmul) if self.roofline else self._weight_part_us + matmul
        t = dense + self._fixed_us + self.kv_coef * self._kv_us_per_token * (kv + tokens)
        t += self.per_request_us * len(new_tokens)
        if self.attention_coef:
            work = float((new_tokens * (progress + new_tokens / 2.0)).sum())
            t += self.attention_coef * self._attn_us_per_pair * work
        return t


class AnchoredModel:
    """A latency model whose step times are scaled by a constant (recording only).

    Teacher forcing needs batches like the real ones. Near the 128-slot cap a model a few
    percent slow queues without bound in the closed loop, and its batches then say more
    about that error than about the server. So trajectories are recorded with the
    candidate scaled to reproduce the experiment's observed ITL (about half a cycle):
    the batches have the observed concurrency, and the candidate is then judged on them.
    The scale never enters a model; validation runs the closed loop unscaled. Everything
    but the step time (the non-step terms, the event gap) is the wrapped model's.
    """

    def __init__(self, model, scale: float):
        self.model = model
        self.scale = float(scale)

    def step_time_us(self, *batch) -> float:
        return self.scale * self.model.step_time_us(*batch)

    def step_program(self) -> StepProgram:
        """The wrapped model's program, scaled (raises ``Unsupported`` where it has none)."""
        inner = getattr(self.model, "step_program", None)
        if inner is None:
            raise Unsupported(f"{type(self.model).__name__} has no step program")
        return inner().scaled(self.scale)

    def __getattr__(self, name):
        if name == "model":  # not yet set (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.model, name)


REFERENCE_EXPRESSION = (
    "1000 + 1.0*weight_time_us + 1.0*kv_io_time_us + 0.3*matmul_time_us + 30*n_layers"
    " + 20*allreduce_calls + 10*batch_size"
)
REFERENCE_OVERHEADS = {"queueing_base_us": 10_000.0}


def reference_model(deployment: Deployment) -> ExpressionLatencyModel:
    """A hand-calibrated physics model to record the first trajectories with.

    Roughly: weights and KV at full HBM bandwidth, ~30 µs per layer of launch and
    synchronisation, ~20 µs per all-reduce, ~1 ms of CPU per step, ~10 ms of API
    overhead. It errs on the fast side, so that no experiment starts in a spurious
    overload; only the batches it produces matter, and they are refreshed with fitted
    models (``calibrated_replay_rows``).
    """
    return ExpressionLatencyModel(REFERENCE_EXPRESSION, deployment, REFERENCE_OVERHEADS)


# ---------------------------------------------------------------------------
# The registry


def _expression(deployment: Deployment, expr: sp.Expr | str, overheads: dict[str, float] | None = None):
    return ExpressionLatencyModel(expr, deployment, overheads)


def _physics(deployment: Deployment, **fields):
    return PhysicsLatencyModel(deployment=deployment, **fields)


def _anchored(deployment: Deployment, model: LatencyModel, scale: float):
    return AnchoredModel(model, scale)


MODELS = {
    "expression": _expression,  # expr, overheads=None
    "physics": _physics,  # any PhysicsLatencyModel field (coefficients, non-step terms)
    "anchored": _anchored,  # model, scale
}


def make_model(name: str, deployment: Deployment, **kw) -> LatencyModel:
    """The latency model NAME for DEPLOYMENT, built from the keywords KW (see ``MODELS``)."""
    build = MODELS.get(name)
    if build is None:
        raise ValueError(f"unknown latency model {name!r}; valid names: {', '.join(MODELS)}")
    return build(deployment, **kw)
