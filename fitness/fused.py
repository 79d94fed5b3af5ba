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

from typing import Mapping

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload

from primitives.language import OPERATORS, Program, bits_float, float_bits

CHUNK_ROWS = 512  # 4 KiB per stack slot: a deep stack and the chunk's design rows stay in L1
VAR, CONST = -1, -2  # opcodes of terminals; operators are their index in OPERATORS
_OPS = list(OPERATORS.values())
OPCODE = {op.name: i for i, op in enumerate(_OPS)}
_JIT = {"nogil": True, "error_model": "numpy"}  # numpy semantics: x/0 is inf, not an exception


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


@numba.njit(**_JIT)
def _run_term(code, arg, lo, hi, consts, cols, c0, m, stack, src, arity):
    """Evaluate the prefix program code[lo:hi] on rows c0..c0+m; the result is in slot 0."""
    sp = 0
    for pc in range(hi - 1, lo - 1, -1):  # prefix read backwards is postfix
        c = code[pc]
        if c == VAR:
            src[sp] = arg[pc]  # a column is read in place, not copied onto the stack
            sp += 1
        elif c == CONST:
            v = consts[arg[pc]]
            buf = stack[sp]
            for r in range(m):
                buf[r] = v
            src[sp] = -1
            sp += 1
        else:
            top = sp - 1
            x = cols[src[top]][c0 : c0 + m] if src[top] >= 0 else stack[top][:m]
            if arity[c] == 1:
                _apply(c, x, x, stack[top], m)
                src[top] = -1
            else:
                y = cols[src[top - 1]][c0 : c0 + m] if src[top - 1] >= 0 else stack[top - 1][:m]
                _apply(c, x, y, stack[top - 1], m)
                src[top - 1] = -1
                sp -= 1
    return cols[src[0]][c0 : c0 + m] if src[0] >= 0 else stack[0][:m]


@numba.njit(fastmath={"reassoc"}, **_JIT)
def _dot(x, y):
    """sum(x * y), reassociated so that it vectorises (a sum in another order is not bit-exact anyway)."""
    s = 0.0
    for r in range(len(x)):
        s += x[r] * y[r]
    return s


@numba.njit(fastmath={"reassoc"}, **_JIT)
def _dot3(x, y, z):
    s = 0.0
    for r in range(len(x)):
        s += x[r] * y[r] * z[r]
    return s


@numba.njit(**_JIT)
def _design_pass(code, arg, starts, consts, cols, depth, w2, wb, X, G, h):
    """The k terms into X (k, n); where ``w2`` is given, G += A^T A and h += A^T b for the
    row-weighted design with the intercept's column of ones, A = [X^T, 1] * w, from
    w2 = w^2 and wb = w * b (rows of weight 0 drop out), all but the intercept's own
    entries G[k, k] and h[k], which do not depend on the terms."""
    k, n = X.shape
    stack = np.empty((depth, CHUNK_ROWS))
    src = np.empty(depth, dtype=np.int64)
    normal = len(w2) > 0
    for c0 in range(0, n, CHUNK_ROWS):
        m = min(CHUNK_ROWS, n - c0)
        for t in range(k):
            out = _run_term(code, arg, starts[t], starts[t + 1], consts, cols, c0, m, stack, src, _ARITY)
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


@numba.njit(**_JIT)
def _step_errors(X, theta, target, experiment, in_train, in_val, n_exp):
    """Per-experiment sums of the relative error on train and validation rows, in row order
    (as ``np.bincount``), for the prediction theta[k] + sum_j theta[j] X[j]; False at the
    first prediction that is not finite and > 0."""
    k, n = X.shape
    tr = np.zeros(n_exp)
    va = np.zeros(n_exp)
    for i in range(n):
        p = 0.0
        for j in range(k):
            p += X[j, i] * theta[j]
        p += theta[k]
        if not (p > 0.0 and p < np.inf):
            return tr, va, False
        ape = abs(p - target[i]) / target[i]
        if in_train[i]:
            tr[experiment[i]] += ape
        if in_val[i]:
            va[experiment[i]] += ape
    return tr, va, True


_NO_G = np.empty((0, 0))


class ColumnMatrix:
    """Primitive columns stacked row-major (one C-contiguous row per primitive), with their index."""

    def __init__(self, columns: Mapping[str, np.ndarray], n: int):
        self.names = list(columns)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.n = n
        self.values = np.empty((max(len(self.names), 1), n))
        for i, name in enumerate(self.names):
            self.values[i] = np.broadcast_to(np.asarray(columns[name], dtype=np.float64), (n,))


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
        self.depth = max((int(np.diff(self.starts).max()) if self.k else 0), 1)

    def _args(self, mat: ColumnMatrix) -> np.ndarray:
        """Token arguments: constant slots as encoded, variable slots as rows of ``mat``."""
        arg = self._var_slot.copy()
        is_var = self.code == VAR
        arg[is_var] = [mat.index[self.names[s]] for s in self._var_slot[is_var]]
        return arg

    def design(self, columns: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        """(n, k + 1): each term on the rows, then the intercept's column of ones."""
        X = np.empty((self.k + 1, n))
        X[-1] = 1.0
        self.terms_into(column_matrix(columns, n), X[:-1])
        return X.T

    def terms_into(self, mat: ColumnMatrix, X: np.ndarray) -> np.ndarray:
        """The terms on the rows of ``mat`` into X (k, n)."""
        none = np.empty(0)
        _design_pass(
            self.code, self._args(mat), self.starts, self.consts, mat.values, self.depth, none, none, X, _NO_G, none
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
        _design_pass(self.code, self._args(mat), self.starts, self.consts, mat.values, self.depth, w2, wb, X, G, h)
        return G, h


def step_errors(X: np.ndarray, theta: np.ndarray, target, experiment, in_train, in_val, n_exp: int):
    """(train sums, validation sums) of the relative error per experiment, or None if a
    prediction is not finite or not > 0."""
    tr, va, ok = _step_errors(X, theta, target, experiment, in_train, in_val, n_exp)
    return (tr, va) if ok else None
