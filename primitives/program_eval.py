"""The numba interpreter of ``primitives.program``: a step time from a batch, no Python call.

Each operation mirrors what the Python evaluator does with the same operands (see
``primitives.program``), so both give the same bits: the features reduce per-request
values exactly (integers and halves, far below 2**53), the scalar program performs the
printed source's operations in order, and the kernel lookups are ``Table1D``/``Table2D``'s own (``primitives.lookup``).
"""

from __future__ import annotations

import math
import sys

import numpy as np
from numba import njit

from . import lookup, program
from .jit_cache import flush_when_changed
from .language import PDIV_EPS
from .lookup import lookup1, lookup2
from .program import (
    ABS,
    ADD,
    CONST,
    DIV,
    FIELD,
    GE,
    GT,
    KERNEL1,
    KERNEL2,
    LE,
    LOAD,
    LOG,
    LT,
    MAX,
    MIN,
    MUL,
    NEG,
    PDIV,
    POW,
    SELECT,
    SQRT,
    STORE,
    SUB,
    StepProgram,
)
from .program import MAX_STACK_DEPTH as STACK_DEPTH


@njit(cache=True, error_model="numpy")
def _run_vector(ops, args, consts, lo, hi, fields, n, stack):
    """Run ops[lo:hi] over the N requests; the result is stack[0, :n]."""
    sp = 0
    for pc in range(lo, hi):
        op = ops[pc]
        if op == FIELD:
            f = fields[args[pc]]
            for i in range(n):
                stack[sp, i] = f[i]
            sp += 1
        elif op == CONST:
            c = consts[pc]
            for i in range(n):
                stack[sp, i] = c
            sp += 1
        elif op == NEG:
            for i in range(n):
                stack[sp - 1, i] = -stack[sp - 1, i]
        else:  # the operation is chosen once per op, not per request
            a, b = sp - 2, sp - 1
            if op == ADD:
                for i in range(n):
                    stack[a, i] = stack[a, i] + stack[b, i]
            elif op == SUB:
                for i in range(n):
                    stack[a, i] = stack[a, i] - stack[b, i]
            elif op == MUL:
                for i in range(n):
                    stack[a, i] = stack[a, i] * stack[b, i]
            elif op == DIV:  # numpy's semantics (error_model="numpy"), as the lambdified numpy source
                for i in range(n):
                    stack[a, i] = stack[a, i] / stack[b, i]
            elif op == LT:
                for i in range(n):
                    stack[a, i] = 1.0 if stack[a, i] < stack[b, i] else 0.0
            elif op == GT:
                for i in range(n):
                    stack[a, i] = 1.0 if stack[a, i] > stack[b, i] else 0.0
            elif op == LE:
                for i in range(n):
                    stack[a, i] = 1.0 if stack[a, i] <= stack[b, i] else 0.0
            elif op == GE:
                for i in range(n):
                    stack[a, i] = 1.0 if stack[a, i] >= stack[b, i] else 0.0
            else:
                for i in range(n):
                    stack[a, i] = np.nan
            sp -= 1


@njit(cache=True, error_model="numpy")
def _run_scalar(ops, args, consts, slots, k1p, k1v, k2p, k2v, stack):
    """The scalar program; returns (value, error) where error is Python raising in the expression."""
    sp = 0
    err = False
    for pc in range(len(ops)):
        op = ops[pc]
        if op == CONST:
            stack[sp] = consts[pc]
            sp += 1
        elif op == LOAD:
            stack[sp] = slots[args[pc]]
            sp += 1
        elif op == STORE:
            sp -= 1
            slots[args[pc]] = stack[sp]
        elif op == KERNEL1:
            stack[sp - 1] = lookup1(k1p[args[pc]], k1v, stack[sp - 1])
        elif op == KERNEL2:
            stack[sp - 2] = lookup2(k2p[args[pc]], k2v, stack[sp - 2], stack[sp - 1])
            sp -= 1
        elif op >= SQRT and op <= ABS or op == NEG:
            x = stack[sp - 1]
            if op == NEG:
                r = -x
            elif op == ABS:
                r = abs(x)
            elif op == SQRT:
                if x < 0:
                    err = True
                r = math.sqrt(x) if x >= 0 else np.nan
            elif op == LOG:
                if x <= 0:
                    err = True
                r = math.log(x) if x > 0 else np.nan
            else:  # EXP
                r = math.exp(x) if x < 710.0 else np.inf
                if math.isinf(r) and not math.isinf(x):
                    err = True
            stack[sp - 1] = r
        elif op == SELECT:
            c = stack[sp - 3]
            stack[sp - 3] = stack[sp - 2] if c != 0 else stack[sp - 1]
            sp -= 2
        else:
            x, y = stack[sp - 2], stack[sp - 1]
            if op == ADD:
                r = x + y
            elif op == SUB:
                r = x - y
            elif op == MUL:
                r = x * y
            elif op == DIV:
                if y == 0:
                    err = True
                    r = np.nan
                else:
                    r = x / y
            elif op == POW:
                if (x == 0 and y < 0) or (x < 0 and y != math.floor(y)):
                    err = True
                    r = np.nan
                else:
                    r = x**y
                    if math.isinf(r) and not math.isinf(x) and not math.isinf(y):
                        err = True
            elif op == MAX:
                r = y if y > x else x
            elif op == MIN:
                r = y if y < x else x
            elif op == PDIV:
                r = x / y if abs(y) > PDIV_EPS else 0.0
            elif op == LT:
                r = 1.0 if x < y else 0.0
            elif op == GT:
                r = 1.0 if x > y else 0.0
            elif op == LE:
                r = 1.0 if x <= y else 0.0
            elif op == GE:
                r = 1.0 if x >= y else 0.0
            else:
                r = np.nan
                err = True
            stack[sp - 2] = r
            sp -= 1
    return stack[0], err


@njit(cache=True, error_model="numpy")
def program_step_time_us(
    vec_ops,
    vec_args,
    vec_consts,
    ranges,
    feat_phase,
    feat_reduce,
    feat_slot,
    sc_ops,
    sc_args,
    sc_consts,
    slots,
    k1p,
    k1v,
    k2p,
    k2v,
    scales,
    fields,
    n,
    vstack,
    masks,
    sstack,
):
    """The step time (µs) of the batch in FIELDS[:, :n]: features, primitives, the expression,
    the 1 µs floor (NaN and Python errors included), then the anchored scales."""
    for ph in range(2):
        _run_vector(vec_ops, vec_args, vec_consts, ranges[ph, 0], ranges[ph, 1], fields, n, vstack)
        for i in range(n):
            masks[ph, i] = vstack[0, i] != 0
    for f in range(len(feat_slot)):
        _run_vector(vec_ops, vec_args, vec_consts, ranges[2 + f, 0], ranges[2 + f, 1], fields, n, vstack)
        ph = feat_phase[f]
        acc = 0.0
        if feat_reduce[f] == 0:
            for i in range(n):
                if ph < 0 or masks[ph, i]:
                    acc += vstack[0, i]
        else:
            first = True
            for i in range(n):
                if ph < 0 or masks[ph, i]:
                    v = vstack[0, i]
                    if first or v > acc:
                        acc = v
                    first = False
        slots[feat_slot[f]] = acc
    value, err = _run_scalar(sc_ops, sc_args, sc_consts, slots, k1p, k1v, k2p, k2v, sstack)
    if err or not value > 1.0:
        value = 1.0
    for s in scales:
        value = s * value
    return value


def program_arrays(p: StepProgram) -> tuple:
    """The program's arrays in ``program_step_time_us``'s order (up to ``scales``)."""
    k = p.kernels
    return (
        p.vec_ops,
        p.vec_args,
        p.vec_consts,
        p.ranges,
        p.feat_phase,
        p.feat_reduce,
        p.feat_slot,
        p.sc_ops,
        p.sc_args,
        p.sc_consts,
        p.slots0.copy(),
        k.t1_params,
        k.t1_values,
        k.t2_params,
        k.t2_values,
        p.scales,
    )


def scratch(capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Work arrays for batches of up to CAPACITY requests: vector stack, phase masks, scalar stack."""
    return (
        np.zeros((STACK_DEPTH, capacity)),
        np.zeros((2, capacity), dtype=np.bool_),
        np.zeros(STACK_DEPTH),
    )


def evaluate(p: StepProgram, progress, new_tokens, input_len, output_len) -> float:
    """One batch's step time through the interpreter (tests, and the Python cross-check)."""
    fields = np.array([progress, new_tokens, input_len, output_len], dtype=np.float64).reshape(4, -1)
    n = fields.shape[1]
    return float(program_step_time_us(*program_arrays(p), fields, n, *scratch(max(n, 1))))


flush_when_changed([_run_vector, _run_scalar, program_step_time_us], [sys.modules[__name__], lookup, program], __name__)
