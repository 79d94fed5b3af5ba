"""Numpy evaluation of the registry: per-request arrays -> features -> primitive columns.

Every function here is generated from the sympy definitions in ``registry`` with
``sympy.lambdify``; nothing is written twice.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping

import numpy as np
import sympy as sp

from .deployment import Deployment
from .registry import (
    CONSTANT_UNITS,
    FEATURE_BY_NAME,
    FEATURES,
    PHASES,
    PRIMITIVE_BY_NAME,
    REQUEST_FIELDS,
)


@lru_cache(maxsize=None)
def _per_request_fn(name: str):
    f = FEATURE_BY_NAME[name]
    return sp.lambdify(REQUEST_FIELDS, f.per_request, modules="numpy")


@lru_cache(maxsize=None)
def _phase_fn(phase: str):
    return sp.lambdify(REQUEST_FIELDS, PHASES[phase], modules="numpy")


@lru_cache(maxsize=None)
def _primitive_fn(name: str):
    p = PRIMITIVE_BY_NAME[name]
    args = sorted(p.features) + sorted(p.constants)
    fn = sp.lambdify(
        [sp.Symbol(a) for a in args], p.expr.subs({s: sp.Symbol(s.name) for s in p.expr.free_symbols}), modules="numpy"
    )
    return fn, args


def features_from_requests(
    step_index: np.ndarray,
    progress: np.ndarray,
    new_tokens: np.ndarray,
    input_len: np.ndarray,
    output_len: np.ndarray,
    n_steps: int,
    names: list[str] | None = None,
) -> dict[str, np.ndarray]:
    """Reduce per-request rows (each tagged with its step's row index) to batch features."""
    cols = [np.asarray(a, dtype=np.float64) for a in (progress, new_tokens, input_len, output_len)]
    step_index = np.asarray(step_index, dtype=np.int64)
    masks = {ph: np.asarray(_phase_fn(ph)(*cols), dtype=bool) & np.ones(len(step_index), bool) for ph in PHASES}
    out: dict[str, np.ndarray] = {}
    for f in FEATURES:
        if names is not None and f.name not in names:
            continue
        values = np.broadcast_to(np.asarray(_per_request_fn(f.name)(*cols), dtype=np.float64), step_index.shape)
        idx, vals = step_index, values
        if f.phase is not None:
            idx, vals = step_index[masks[f.phase]], values[masks[f.phase]]
        if f.reduce == "sum":
            out[f.name] = np.bincount(idx, weights=vals, minlength=n_steps).astype(np.float64)
        elif f.reduce == "max":
            acc = np.zeros(n_steps, dtype=np.float64)
            np.maximum.at(acc, idx, vals)
            out[f.name] = acc
        else:  # pragma: no cover - registry invariant
            raise ValueError(f"unknown reduction {f.reduce!r}")
    return out


def primitive_columns(
    features: Mapping[str, np.ndarray],
    constants: Mapping[str, float | np.ndarray],
    names: list[str],
) -> dict[str, np.ndarray]:
    """Evaluate primitives over feature columns; constants may be scalars or per-row arrays."""
    n = len(next(iter(features.values()))) if features else len(np.atleast_1d(next(iter(constants.values()))))
    out = {}
    for name in names:
        fn, args = _primitive_fn(name)
        values = [features[a] if a in FEATURE_BY_NAME else constants[a] for a in args]
        out[name] = np.broadcast_to(np.asarray(fn(*values), dtype=np.float64), (n,)).copy()
    return out


def constant_columns(deployments: list[Deployment], row_deployment: np.ndarray) -> dict[str, np.ndarray]:
    """Per-row deployment constants, for datasets that mix deployments."""
    table = np.array([[d.constants[k] for k in CONSTANT_UNITS] for d in deployments], dtype=np.float64)
    rows = table[np.asarray(row_deployment, dtype=np.int64)]
    return {k: rows[:, i] for i, k in enumerate(CONSTANT_UNITS)}


@lru_cache(maxsize=None)
def _scalar_primitive_fn(name: str):
    """The primitive as a function of scalars (math module): cheap per simulated step."""
    p = PRIMITIVE_BY_NAME[name]
    args = sorted(p.features) + sorted(p.constants)
    expr = p.expr.subs({s: sp.Symbol(s.name) for s in p.expr.free_symbols})
    return sp.lambdify([sp.Symbol(a) for a in args], expr, modules="math"), args


class BatchPrimitives:
    """Primitive values of one batch, for simulators that need them step by step.

    Same registry definitions as ``features_from_requests``/``primitive_columns``, on a
    fast path for a single batch: one phase mask, one numpy reduction per feature and
    scalar (math-module) primitive functions with the deployment constants bound.
    """

    def __init__(self, deployment: Deployment, names: list[str]):
        self.names = list(names)
        self.constants = deployment.constants
        needed: set[str] = set()
        for n in self.names:
            needed |= PRIMITIVE_BY_NAME[n].features
        self.feature_names = sorted(needed)
        self._features = [
            (f, _per_request_fn(f), FEATURE_BY_NAME[f].phase, FEATURE_BY_NAME[f].reduce) for f in self.feature_names
        ]
        self._phases = sorted({ph for _, _, ph, _ in self._features if ph is not None})
        self._prims = []
        for n in self.names:
            fn, args = _scalar_primitive_fn(n)
            self._prims.append((n, fn, args))

    def scalars(self, progress, new_tokens, input_len, output_len) -> dict[str, float]:
        cols = tuple(np.asarray(c, dtype=np.float64) for c in (progress, new_tokens, input_len, output_len))
        masks = {ph: np.asarray(_phase_fn(ph)(*cols), dtype=bool) for ph in self._phases}
        values: dict[str, float] = dict(self.constants)
        n = len(progress)
        for name, fn, phase, reduce in self._features:
            v = fn(*cols)
            if np.ndim(v) == 0:
                v = np.full(n, float(v))
            if phase is not None:
                v = v[masks[phase]]
            if reduce == "sum":
                values[name] = float(v.sum())
            else:
                values[name] = float(v.max()) if len(v) else 0.0
        return {n: float(fn(*[values[a] for a in args])) for n, fn, args in self._prims}

    def __call__(self, progress, new_tokens, input_len, output_len) -> dict[str, np.ndarray]:
        return {k: np.array([v]) for k, v in self.scalars(progress, new_tokens, input_len, output_len).items()}


__all__ = [
    "features_from_requests",
    "primitive_columns",
    "constant_columns",
    "BatchPrimitives",
]
