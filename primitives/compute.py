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
from .kernels import KernelTables
from .registry import (
    CONSTANT_UNITS,
    FEATURE_BY_NAME,
    FEATURES,
    KERNEL_ARITY,
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


def _plain(expr: sp.Expr) -> sp.Expr:
    return expr.subs({s: sp.Symbol(s.name) for s in expr.free_symbols})


@lru_cache(maxsize=None)
def _primitive_parts(name: str, module: str = "numpy"):
    """The primitive as (outer function, its argument names, kernel calls).

    A measured-kernel lookup can not be lambdified (its tables belong to a deployment),
    so each call is cut out: ``calls`` lists (kernel name, function of the arguments,
    argument names), and its result enters the outer function as ``__kernel<i>``.
    """
    p = PRIMITIVE_BY_NAME[name]
    expr = _plain(p.expr)
    calls = []
    for i, call in enumerate(sorted((f for f in expr.atoms(sp.Function) if f.func.__name__ in KERNEL_ARITY), key=str)):
        inner = sorted({s.name for a in call.args for s in a.free_symbols})
        fn = sp.lambdify([sp.Symbol(a) for a in inner], list(call.args), modules=module)
        calls.append((call.func.__name__, fn, inner))
        expr = expr.subs(call, sp.Symbol(f"__kernel{i}"))
    args = sorted(s.name for s in expr.free_symbols)
    return sp.lambdify([sp.Symbol(a) for a in args], expr, modules=module), args, calls


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
    kernels: KernelTables | tuple[list[KernelTables], np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Evaluate primitives over feature columns; constants may be scalars or per-row arrays.

    ``kernels`` serves the measured-kernel lookups: one deployment's tables, or a list
    of tables with each row's index into it (datasets that mix deployments).
    """
    n = len(next(iter(features.values()))) if features else len(np.atleast_1d(next(iter(constants.values()))))
    out = {}
    values = {**constants, **features}  # plus each primitive's __kernel<i> results, set before use
    for name in names:
        fn, args, calls = _primitive_parts(name)
        for i, (kernel, arg_fn, inner) in enumerate(calls):
            call_args = [
                np.broadcast_to(np.asarray(a, dtype=np.float64), (n,)) for a in arg_fn(*[values[a] for a in inner])
            ]
            values[f"__kernel{i}"] = _lookup(kernels, kernel, call_args, n, name)
        out[name] = np.broadcast_to(np.asarray(fn(*[values[a] for a in args]), dtype=np.float64), (n,)).copy()
    return out


def kernel_binding(names: list[str], deployments: list[Deployment], row_deployment: np.ndarray | None = None):
    """The ``kernels`` argument of ``primitive_columns`` for these deployments (None if unused)."""
    if not any(PRIMITIVE_BY_NAME[n].kernels for n in names):
        return None
    if row_deployment is None:
        (only,) = deployments
        return only.kernels
    return [d.kernels for d in deployments], np.asarray(row_deployment, dtype=np.int64)


def _lookup(kernels, kernel: str, args: list[np.ndarray], n: int, primitive: str) -> np.ndarray:
    if kernels is None:
        raise ValueError(f"primitive {primitive!r} needs measured kernel tables")
    if isinstance(kernels, KernelTables):
        return kernels.functions()[kernel](*args)
    tables, row_index = kernels
    out = np.zeros(n)
    for j, table in enumerate(tables):
        rows = row_index == j
        if rows.any():
            out[rows] = table.functions()[kernel](*[a[rows] for a in args])
    return out


def constant_columns(deployments: list[Deployment], row_deployment: np.ndarray) -> dict[str, np.ndarray]:
    """Per-row deployment constants, for datasets that mix deployments."""
    table = np.array([[d.constants[k] for k in CONSTANT_UNITS] for d in deployments], dtype=np.float64)
    rows = table[np.asarray(row_deployment, dtype=np.int64)]
    return {k: rows[:, i] for i, k in enumerate(CONSTANT_UNITS)}


class BatchPrimitives:
    """Primitive values of one batch, for simulators that need them step by step.

    Same registry definitions as ``features_from_requests``/``primitive_columns``, on a
    fast path for a single batch: one phase mask, one numpy reduction per feature and
    scalar (math-module) primitive functions with the deployment constants bound.
    """

    def __init__(self, deployment: Deployment, names: list[str]):
        self.names = list(names)
        self.constants = deployment.constants
        needs_kernels = any(PRIMITIVE_BY_NAME[n].kernels for n in self.names)
        self.kernel_functions = deployment.kernels.functions() if needs_kernels else {}
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
            self._prims.append((n, *_primitive_parts(n, "math")))

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
        out = {}
        for n, fn, args, calls in self._prims:
            for i, (kernel, arg_fn, inner) in enumerate(calls):
                values[f"__kernel{i}"] = self.kernel_functions[kernel](*arg_fn(*[values[a] for a in inner]))
            out[n] = float(fn(*[values[a] for a in args]))
        return out

    def __call__(self, progress, new_tokens, input_len, output_len) -> dict[str, np.ndarray]:
        return {k: np.array([v]) for k, v in self.scalars(progress, new_tokens, input_len, output_len).items()}


__all__ = [
    "features_from_requests",
    "primitive_columns",
    "constant_columns",
    "kernel_binding",
    "BatchPrimitives",
]
