"""Fused evaluation of a candidate's terms: one compiled pass over the rows, in cache-sized chunks.

The plain way (``primitives.language.evaluate_program``) makes one 100k-row array per
node, so a 10-node tree streams ~10 arrays through memory and the least squares then
multiplies the design matrix again. Here the terms of a candidate are encoded once as
bytecode and a numba-compiled stack machine runs them over ``CHUNK_ROWS`` rows at a
time: the stack lives in L1, each operator is a vectorised loop over the chunk, and the
same pass writes the design matrix (terms x rows) and accumulates the normal equations
``A^T A`` and ``A^T b`` of the weighted rows. A second compiled pass turns the fitted
constants into the per-experiment relative errors, without a prediction array.

The operators are not listed here: their scalar forms (``Operator.scalar_fn``) are read
from ``primitives.language.OPERATORS`` and compiled into one dispatch function, so an
operator added to the table is evaluated here too. Everything is float64: the columns
are float64 already, and the measured gain of float32 columns did not pay for its error
(docs/RESULTS.md, "Speed: fitness evaluation").
"""

from __future__ import annotations

import sys
from typing import Mapping

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload

import primitives.language
from primitives.jit_cache import flush_when_changed
from primitives.language import OPERATORS, Program, bits_float, float_bits

CHUNK_ROWS = 1024  # 8 KiB per stack slot: the stack stays in L1/L2; measured faster than 512 or 2048
# opcodes of terminals (a column stored as float64 or float32, a constant); operators are
# their index in OPERATORS
VAR, VAR32, CONST = -1, -3, -2
_OPS = list(OPERATORS.values())
OPCODE = {op.name: i for i, op in enumerate(_OPS)}
_JIT = {"nogil": True, "error_model": "numpy"}  # numpy semantics: x/0 is inf, not an exception


def _kernel(**flags):
    """``numba.njit`` cached on disk (a second process loads instead of compiling); the cache
    is flushed when this file or the operator table changes (bottom of this module)."""
    return numba.njit(cache=True, **_JIT, **flags)


@intrinsic
def _bitcast(typingctx, value, to):
    """Reinterpret a float64 as int64 or back: a no-op the vectoriser keeps."""
    target = to.dtype if isinstance(to, types.NumberClass) else to

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType() if target == types.float64 else ir.IntType(64))

    return target(value, to), codegen


@overload(float_bits, jit_options={"inline": "always"})
def _float_bits(x):
    return lambda x: _bitcast(np.float64(x), np.int64)


@overload(bits_float, jit_options={"inline": "always"})
def _bits_float(b):
    return lambda b: _bitcast(np.int64(b), np.float64)


def _compile_dispatch():
    """``apply(code, x, y, out, m)``: out[:m] = op(x, y) over a chunk, one loop per operator.

    Generated from the operator table (the source is the single home of each operator);
    a unary operator ignores ``y``.
    """
    env = {}
    lines = ["def apply(code, x, y, out, m):"]
    for i, op in enumerate(_OPS):
        env[f"f{i}"] = numba.njit(inline="always", **_JIT)(op.scalar_fn)
        args = "x[r], y[r]" if op.arity == 2 else "x[r]"
        lines += [f"    {'if' if i == 0 else 'elif'} code == {i}:", "        for r in range(m):"]
        lines += [f"            out[r] = f{i}({args})"]
    exec(compile("\n".join(lines), "<fitness.fused operators>", "exec"), env)  # noqa: S102
    return numba.njit(**_JIT)(env["apply"])


_apply = _compile_dispatch()
_ARITY = np.array([op.arity for op in _OPS], dtype=np.int64)


@_kernel()
def _run_term(code, arg, lo, hi, consts, cols, cols32, c0, m, rows, slot, arity):
    """Evaluate the prefix program code[lo:hi] on rows c0..c0+m; returns the row holding it.

    Stack level i lives in ``rows[slot[i]]``; ``slot[-1]`` is a spare row that every
    operator writes into before the rows are relabelled, because a loop whose output
    overlaps its input is not vectorised. A column is copied onto the stack (into float64,
    whatever its storage): the copy stays in L1, the read from memory is paid either way.
    """
    spare = len(slot) - 1
    sp = 0
    for pc in range(hi - 1, lo - 1, -1):  # prefix read backwards is postfix
        c = code[pc]
        if c < 0:
            buf = rows[slot[sp]]
            if c == VAR:
                col = cols[arg[pc]]
                for r in range(m):
                    buf[r] = col[c0 + r]
            elif c == VAR32:
                col32 = cols32[arg[pc]]
                for r in range(m):
                    buf[r] = col32[c0 + r]
            else:
                v = consts[arg[pc]]
                for r in range(m):
                    buf[r] = v
            sp += 1
            continue
        x = rows[slot[sp - 1]]
        out = rows[slot[spare]]
        lvl = sp - 1
        if arity[c] == 1:
            _apply(c, x, x, out, m)
        else:
            lvl = sp - 2
            _apply(c, x, rows[slot[lvl]], out, m)
            sp -= 1
        slot[lvl], slot[spare] = slot[spare], slot[lvl]
    return rows[slot[0]]


@_kernel(fastmath={"reassoc"})
def _dot(x, y):
    """sum(x * y), reassociated so that it vectorises (a sum in another order is not bit-exact anyway)."""
    s = 0.0
    for r in range(len(x)):
        s += x[r] * y[r]
    return s


@_kernel(fastmath={"reassoc"})
def _dot3(x, y, z):
    s = 0.0
    for r in range(len(x)):
        s += x[r] * y[r] * z[r]
    return s


@_kernel()
def _design_pass(code, arg, starts, consts, cols, cols32, depth, w2, wb, X, G, h):
    """The k terms into X (k, n); where ``w2`` is given, G += A^T A and h += A^T b for the
    row-weighted design with the intercept's column of ones, A = [X^T, 1] * w, from
    w2 = w^2 and wb = w * b (rows of weight 0 drop out), all but the intercept's own
    entries G[k, k] and h[k], which do not depend on the terms."""
    k, n = X.shape
    rows = np.empty((depth + 1, CHUNK_ROWS))
    slot = np.arange(depth + 1)
    normal = len(w2) > 0
    for c0 in range(0, n, CHUNK_ROWS):
        m = min(CHUNK_ROWS, n - c0)
        for t in range(k):
            out = _run_term(code, arg, starts[t], starts[t + 1], consts, cols, cols32, c0, m, rows, slot, _ARITY)
            xt = X[t]
            for r in range(m):
                xt[c0 + r] = out[r]
        if normal:
            w2c = w2[c0 : c0 + m]
            wbc = wb[c0 : c0 + m]
            for j in range(k):
                xj = X[j][c0 : c0 + m]
                h[j] += _dot(xj, wbc)
                G[k, j] += _dot(xj, w2c)
                for i in range(j + 1):
                    G[j, i] += _dot3(xj, X[i][c0 : c0 + m], w2c)
    if normal:
        for j in range(k + 1):
            for i in range(j):
                G[i, j] = G[j, i]


@_kernel(fastmath={"reassoc"})
def _error_sum(X, theta, target, lo, hi, pred):
    """Sum over rows lo..hi of |p - target| / target for p = theta[k] + sum_j theta[j] X[j];
    NaN if a prediction is not finite and > 0."""
    k = X.shape[0]
    total = 0.0
    for c0 in range(lo, hi, CHUNK_ROWS):
        m = min(CHUNK_ROWS, hi - c0)
        for r in range(m):
            pred[r] = theta[k]
        for j in range(k):
            xj = X[j]
            tj = theta[j]
            for r in range(m):
                pred[r] += tj * xj[c0 + r]
        nonpositive = 0.0
        nonfinite = 0.0  # p - p is NaN for an inf or a NaN: sums vectorise, a branch would not
        for r in range(m):
            p = pred[r]
            nonpositive += 1.0 if p <= 0.0 else 0.0
            nonfinite += p - p
            total += abs(p - target[c0 + r]) / target[c0 + r]
        if nonpositive > 0.0 or nonfinite != 0.0:
            return np.nan
    return total


@_kernel()
def _step_errors(X, theta, target, train_rows, val_rows, tr, va):
    """tr[e], va[e] = error sums over experiment e's training rows train_rows[e, 0]:train_rows[e, 1]
    and validation rows (``val_rows`` alike; rows grouped so that each set is contiguous);
    False if a prediction is not finite and > 0."""
    pred = np.empty(CHUNK_ROWS)
    for e in range(len(tr)):
        tr[e] = _error_sum(X, theta, target, train_rows[e, 0], train_rows[e, 1], pred)
        same = val_rows[e, 0] == train_rows[e, 0] and val_rows[e, 1] == train_rows[e, 1]
        va[e] = tr[e] if same else _error_sum(X, theta, target, val_rows[e, 0], val_rows[e, 1], pred)
        if np.isnan(tr[e]) or np.isnan(va[e]):
            return False
    return True


_NO_G = np.empty((0, 0))


class ColumnMatrix:
    """Primitive columns stacked row-major, one C-contiguous row per primitive: as float32 where
    that is exact (counts, tokens, layers: half the bytes to read, nothing lost), else float64."""

    def __init__(self, columns: Mapping[str, np.ndarray], n: int):
        self.n = n
        values = {name: np.broadcast_to(np.asarray(v, dtype=np.float64), (n,)) for name, v in columns.items()}
        exact = {
            name: np.array_equal(v.astype(np.float32).astype(np.float64), v, equal_nan=True)
            for name, v in values.items()
        }
        names64 = [name for name in values if not exact[name]]
        names32 = [name for name in values if exact[name]]
        self.values = np.empty((max(len(names64), 1), n))
        self.values32 = np.empty((max(len(names32), 1), n), dtype=np.float32)
        self.index: dict[str, tuple[int, int]] = {}  # name -> (opcode, row)
        for i, name in enumerate(names64):
            self.values[i] = values[name]
            self.index[name] = (VAR, i)
        for i, name in enumerate(names32):
            self.values32[i] = values[name]
            self.index[name] = (VAR32, i)


_MATRICES: dict[int, tuple[Mapping, ColumnMatrix]] = {}
_MAX_MATRICES = 64  # step table, probe batches, replayed experiments: a handful per context


def column_matrix(columns: Mapping[str, np.ndarray], n: int) -> ColumnMatrix:
    """The stacked form of a column mapping, built once (the mapping is held, so its id stays its own)."""
    hit = _MATRICES.get(id(columns))
    if hit is not None and hit[0] is columns and hit[1].n == n:
        return hit[1]
    if len(_MATRICES) >= _MAX_MATRICES:
        _MATRICES.clear()
    mat = ColumnMatrix(columns, n)
    _MATRICES[id(columns)] = (columns, mat)
    return mat


class FusedTerms:
    """The additive terms of one candidate as bytecode for the compiled evaluator."""

    def __init__(self, terms: list[Program]):
        self.k = len(terms)
        code, arg, starts, consts, names = [], [], [0], [], []
        for term in terms:
            for kind, value in term:
                if kind == "op":
                    code.append(OPCODE[value])
                    arg.append(0)
                elif kind == "var":
                    code.append(VAR)
                    arg.append(len(names))
                    names.append(value)
                else:
                    code.append(CONST)
                    arg.append(len(consts))
                    consts.append(float(value))
            starts.append(len(code))
        self.code = np.array(code, dtype=np.int64)
        self._var_slot = np.array(arg, dtype=np.int64)  # var tokens: index into self.names
        self.starts = np.array(starts, dtype=np.int64)
        self.consts = np.array(consts or [0.0])
        self.names = names
        self.depth = max(max((len(t) for t in terms), default=0), 1)  # a stack never deeper than its term

    def _bind(self, mat: ColumnMatrix) -> tuple[np.ndarray, np.ndarray]:
        """Opcodes and arguments on ``mat``: a variable reads its row of the float64 or float32 block."""
        code = self.code.copy()
        arg = self._var_slot.copy()
        for pc in np.flatnonzero(self.code == VAR):
            code[pc], arg[pc] = mat.index[self.names[self._var_slot[pc]]]
        return code, arg

    def design(self, columns: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        """(n, k + 1): each term on the rows, then the intercept's column of ones."""
        X = np.empty((self.k + 1, n))
        X[-1] = 1.0
        self.terms_into(column_matrix(columns, n), X[:-1])
        return X.T

    def terms_into(self, mat: ColumnMatrix, X: np.ndarray) -> np.ndarray:
        """The terms on the rows of ``mat`` into X (k, n)."""
        none = np.empty(0)
        code, arg = self._bind(mat)
        _design_pass(
            code, arg, self.starts, self.consts, mat.values, mat.values32, self.depth, none, none, X, _NO_G, none
        )
        return X

    def normal_equations(
        self, mat: ColumnMatrix, w2: np.ndarray, wb: np.ndarray, X: np.ndarray, w2_sum: float, wb_sum: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """The terms into X (k, n), and G = A^T A, h = A^T b for A = [X^T, 1] * w, from
        w2 = w^2 and wb = w * b (both 0 on rows left out; ``w2_sum`` and ``wb_sum`` are
        their sums). X is the caller's buffer: a fresh array of this size would cost more
        in page faults than the pass itself."""
        k1 = self.k + 1
        G = np.zeros((k1, k1))
        h = np.zeros(k1)
        G[-1, -1], h[-1] = w2_sum, wb_sum
        code, arg = self._bind(mat)
        _design_pass(code, arg, self.starts, self.consts, mat.values, mat.values32, self.depth, w2, wb, X, G, h)
        return G, h


def step_errors(
    X: np.ndarray, theta: np.ndarray, target: np.ndarray, train_rows: np.ndarray, val_rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """(train sums, validation sums) of the relative error per experiment (see ``_step_errors``),
    or None if a prediction is not finite or not > 0."""
    tr = np.zeros(len(train_rows))
    va = np.zeros(len(train_rows))
    return (tr, va) if _step_errors(X, theta, target, train_rows, val_rows, tr, va) else None


flush_when_changed(
    [_run_term, _dot, _dot3, _design_pass, _error_sum, _step_errors],
    [sys.modules[__name__], primitives.language],
    __name__,
)
