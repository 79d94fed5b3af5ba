"""Step-time models as flat programs, for the compiled simulator core (``fitness.sim.core``).

The closed loop asks for one step time per step; a Python call per step costs more than
the whole compiled step. So a model becomes data: small stack programs that a numba
interpreter (``primitives.program_eval``) runs over the batch.

Nothing is written twice. Each program is compiled from the very source that
``sympy.lambdify`` printed for the Python evaluator (the registry's features, phases and
primitives in ``primitives.compute``, the candidate's expression in its latency model):
the printed source is parsed with :mod:`ast` and emitted in Python's evaluation order, so
the interpreter performs the same IEEE operations in the same order and returns the same
bits. Python's exceptions in the scalar expression (division by zero, a logarithm or
square root out of its domain, an overflowing ``exp`` or ``**``) set an error flag, which
the model's floor turns into 1 µs exactly as ``ExpressionLatencyModel`` does. A source the
compiler does not know raises :class:`Unsupported`; such a model runs on the Python path.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass

import numpy as np

from .compute import _per_request_fn, _phase_fn, _primitive_parts
from .kernels import Table1D, Table2D
from .lookup import OFFSET_1D, OFFSET_2D
from .registry import CONSTANT_UNITS, FEATURE_BY_NAME, PRIMITIVE_BY_NAME, REQUEST_FIELDS

# opcodes (shared with primitives.program_eval)
CONST, LOAD, STORE, ADD, SUB, MUL, DIV, POW, NEG = range(9)
SQRT, LOG, EXP, ABS, MAX, MIN, PDIV, LT, GT, LE, GE, SELECT, KERNEL1, KERNEL2, FIELD = range(9, 24)

_BINOPS = {ast.Add: ADD, ast.Sub: SUB, ast.Mult: MUL, ast.Div: DIV, ast.Pow: POW}
_COMPARE = {ast.Lt: LT, ast.Gt: GT, ast.LtE: LE, ast.GtE: GE}
_CALLS = {"sqrt": SQRT, "log": LOG, "exp": EXP, "abs": ABS, "pdiv": PDIV}
_FOLDS = {"max": MAX, "Max": MAX, "min": MIN, "Min": MIN}
_NUMPY_COMPARE = {"less": LT, "greater": GT, "less_equal": LE, "greater_equal": GE}
PHASE_CODES = {None: -1, "prefill": 0, "decode": 1}
REDUCE_CODES = {"sum": 0, "max": 1}


MAX_STACK_DEPTH = 64  # the interpreter's stack (``program_eval.STACK_DEPTH``)
_PUSH = {CONST, LOAD, FIELD}
_POP1 = {ADD, SUB, MUL, DIV, POW, MAX, MIN, PDIV, LT, GT, LE, GE, STORE, KERNEL2}


def _stack_depth(ops: np.ndarray) -> int:
    depth = top = 0
    for op in ops.tolist():
        top += 1 if op in _PUSH else -2 if op == SELECT else -1 if op in _POP1 else 0
        depth = max(depth, top)
    return depth


class Unsupported(ValueError):
    """A printed source outside what the interpreter runs (the model stays on the Python path)."""


class _Emitter:
    def __init__(self):
        self.ops: list[int] = []
        self.args: list[int] = []
        self.consts: list[float] = []

    def emit(self, op: int, arg: int = 0, const: float = 0.0) -> None:
        self.ops.append(op)
        self.args.append(arg)
        self.consts.append(const)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (
            np.array(self.ops, dtype=np.int64),
            np.array(self.args, dtype=np.int64),
            np.array(self.consts, dtype=np.float64),
        )


def _lambdified_source(fn) -> str:
    """The source sympy printed for FN, checked against FN's own bytecode.

    sympy files each printed function in ``linecache`` under ``<lambdifygenerated-N>``, N
    counting per process. A function that reached this process pickled (a worker) keeps
    its parent's N, and here that name may hold another function this process printed:
    the wrong source, silently (a model's step program became ``n_layers``). So each
    candidate, ``linecache``'s and the one lambdify writes into the docstring, is used
    only if it compiles to FN's code."""
    candidates = []
    try:
        candidates.append(inspect.getsource(fn))
    except (OSError, TypeError):
        pass
    doc = fn.__doc__ or ""
    head, _, rest = doc.partition("Source code:\n\n")
    if head:
        candidates.append(rest.partition("\n\nImported modules:")[0])
    for source in candidates:
        if source.startswith("def ") and _compiles_to(source, fn.__code__):
            return source
    raise Unsupported("the lambdified source is not available")


def _compiles_to(source: str, code) -> bool:
    """Whether SOURCE (one ``def``) compiles to a function with CODE's bytecode, names and constants."""
    try:
        module = compile(source, code.co_filename, "exec")
    except SyntaxError:
        return False
    mine = next((c for c in module.co_consts if hasattr(c, "co_code")), None)
    fields = ("co_code", "co_consts", "co_names", "co_varnames", "co_argcount")
    return mine is not None and all(getattr(mine, f) == getattr(code, f) for f in fields)


def _returned_expression(fn) -> tuple[ast.expr, list[str]]:
    tree = ast.parse(_lambdified_source(fn))
    func = tree.body[0]
    if not isinstance(func, ast.FunctionDef) or len(func.body) != 1 or not isinstance(func.body[0], ast.Return):
        raise Unsupported("expected a one-line lambdified function")
    return func.body[0].value, [a.arg for a in func.args.args]


def _call_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.attr  # math.sqrt, numpy.less
    raise Unsupported(f"call of {ast.dump(node)}")


def _emit(node: ast.expr, out: _Emitter, slot_of: dict[str, int], kernels: dict[str, tuple[int, int]]) -> None:
    """Emit NODE in Python's evaluation order (left operand first)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        out.emit(CONST, 0, float(node.value))
    elif isinstance(node, ast.Name):
        if node.id not in slot_of:
            raise Unsupported(f"unknown name {node.id!r}")
        out.emit(LOAD, slot_of[node.id])
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        _emit(node.left, out, slot_of, kernels)
        _emit(node.right, out, slot_of, kernels)
        out.emit(_BINOPS[type(node.op)])
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        _emit(node.operand, out, slot_of, kernels)
        if isinstance(node.op, ast.USub):
            out.emit(NEG)
    elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        _emit(node.left, out, slot_of, kernels)
        _emit(node.comparators[0], out, slot_of, kernels)
        out.emit(_COMPARE[type(node.ops[0])])
    elif isinstance(node, ast.IfExp):
        _emit(node.test, out, slot_of, kernels)
        _emit(node.body, out, slot_of, kernels)
        _emit(node.orelse, out, slot_of, kernels)
        out.emit(SELECT)
    elif isinstance(node, ast.Call) and not node.keywords:
        name = _call_name(node.func)
        args = node.args
        if name in _FOLDS and len(args) >= 2:  # max(a, b, c): a new value wins only if strictly better
            _emit(args[0], out, slot_of, kernels)
            for a in args[1:]:
                _emit(a, out, slot_of, kernels)
                out.emit(_FOLDS[name])
        elif name in _CALLS and len(args) == (2 if name == "pdiv" else 1):
            for a in args:
                _emit(a, out, slot_of, kernels)
            out.emit(_CALLS[name])
        elif name in _NUMPY_COMPARE and len(args) == 2:
            for a in args:
                _emit(a, out, slot_of, kernels)
            out.emit(_NUMPY_COMPARE[name])
        else:
            raise Unsupported(f"call of {name}/{len(args)}")
    else:
        raise Unsupported(f"node {type(node).__name__}")


def emit_function(fn, out: _Emitter, slot_of: dict[str, int]) -> None:
    """Emit the expression lambdified function FN returns; its arguments are read from slots."""
    body, params = _returned_expression(fn)
    _emit(body, out, {p: slot_of[p] for p in params if p in slot_of}, {})


def _emit_list(fn, out: _Emitter, slot_of: dict[str, int]) -> int:
    """Emit each element of the list FN returns (kernel arguments), in order; returns how many."""
    body, params = _returned_expression(fn)
    if not isinstance(body, ast.List):
        raise Unsupported("expected a list of kernel arguments")
    local = {p: slot_of[p] for p in params}
    for element in body.elts:
        _emit(element, out, local, {})
    return len(body.elts)


@dataclass(frozen=True)
class KernelPack:
    """Every lookup table a program calls: 1-D and 2-D, flattened (see ``program_eval``)."""

    t1_params: np.ndarray  # (n, 4): start, step, count, offset into t1_values
    t1_values: np.ndarray
    t2_params: np.ndarray  # (n, 8): x start, step, count, y start, step, count, offset, (unused)
    t2_values: np.ndarray


def _pack_kernels(tables: list) -> tuple[KernelPack, dict[int, tuple[int, int]]]:
    p1, v1, p2, v2, index = [], [], [], [], {}
    for t in tables:
        if id(t) in index:
            continue
        if isinstance(t, (Table1D, Table2D)):  # their own parameter vectors, offset into the packed values
            one = isinstance(t, Table1D)
            params, values = t.packed
            ps, vs = (p1, v1) if one else (p2, v2)
            params = params.copy()
            params[OFFSET_1D if one else OFFSET_2D] = sum(len(v) for v in vs)
            index[id(t)] = (KERNEL1 if one else KERNEL2, len(ps))
            ps.append(params)
            vs.append(values)
        else:
            raise Unsupported(f"kernel lookup of type {type(t).__name__}")
    cat = lambda vs: np.concatenate(vs) if vs else np.zeros(1)  # noqa: E731
    pack = KernelPack(
        np.array(p1, dtype=np.float64).reshape(-1, 4),
        cat(v1),
        np.array(p2, dtype=np.float64).reshape(-1, 8),
        cat(v2),
    )
    return pack, index


@dataclass(frozen=True)
class StepProgram:
    """One deployment's model as programs: features over the batch, then one scalar program.

    ``vec_*``: the phase masks and feature programs over the request fields (``FIELD k``
    pushes field k of REQUEST_FIELDS), ``ranges`` rows (start, end) into them: rows 0 and 1
    the prefill and decode masks, then one per feature with its phase, reduction and slot.
    ``sc_*``: the scalar program (primitives, then the model's expression; STOREs into
    ``slots0``, a copy of which holds the constants). ``scales``: the anchored factors
    applied, innermost first, after the 1 µs floor.
    """

    vec_ops: np.ndarray
    vec_args: np.ndarray
    vec_consts: np.ndarray
    ranges: np.ndarray  # (2 + n_features, 2)
    feat_phase: np.ndarray
    feat_reduce: np.ndarray
    feat_slot: np.ndarray
    sc_ops: np.ndarray
    sc_args: np.ndarray
    sc_consts: np.ndarray
    slots0: np.ndarray
    kernels: KernelPack
    scales: np.ndarray

    def scaled(self, scale: float) -> "StepProgram":
        from dataclasses import replace

        return replace(self, scales=np.append(self.scales, float(scale)))


def step_program(
    constants: dict[str, float], kernel_functions: dict, primitive_names: list[str], expr_fn
) -> StepProgram:
    """The program of EXPR_FN (a lambdified scalar function of the primitives PRIMITIVE_NAMES)
    for a deployment's CONSTANTS and kernel lookups (``KernelTables.functions()``)."""
    features = sorted({f for n in primitive_names for f in PRIMITIVE_BY_NAME[n].features})
    slots: dict[str, int] = {}
    for name in list(CONSTANT_UNITS) + features + ["__kernel0", "__kernel1", "__kernel2"]:
        slots[name] = len(slots)
    prim_slot = {n: len(slots) + i for i, n in enumerate(primitive_names)}
    n_slots = len(slots) + len(primitive_names)
    slots0 = np.zeros(n_slots)
    for name in CONSTANT_UNITS:
        slots0[slots[name]] = float(constants[name])

    # vector programs: the two phase masks, then each feature's per-request expression
    vec = _Emitter()
    fields = {s.name: i for i, s in enumerate(REQUEST_FIELDS)}
    field_slots = {name: -(1 + i) for name, i in fields.items()}  # LOAD of a negative slot: a field
    ranges, phase, reduce, fslot = [], [], [], []
    for fn in [_phase_fn("prefill"), _phase_fn("decode")] + [_per_request_fn(f) for f in features]:
        start = len(vec.ops)
        emit_function(fn, vec, field_slots)
        ranges.append((start, len(vec.ops)))
    for f in features:
        spec = FEATURE_BY_NAME[f]
        phase.append(PHASE_CODES[spec.phase])
        reduce.append(REDUCE_CODES[spec.reduce])
        fslot.append(slots[f])
    vec_ops, vec_args, vec_consts = vec.arrays()
    is_field = (vec_ops == LOAD) & (vec_args < 0)
    vec_ops[is_field] = FIELD
    vec_args[is_field] = -vec_args[is_field] - 1

    # scalar program: every primitive (its kernel calls first), then the expression
    tables = [kernel_functions[k] for n in primitive_names for k, _, _ in _primitive_parts(n, "math")[2]]
    pack, table_index = _pack_kernels(tables)
    sc = _Emitter()
    for n in primitive_names:
        fn, _, calls = _primitive_parts(n, "math")
        for i, (kernel, arg_fn, _) in enumerate(calls):
            _emit_list(arg_fn, sc, slots)
            op, t = table_index[id(kernel_functions[kernel])]
            sc.emit(op, t)
            sc.emit(STORE, slots[f"__kernel{i}"])
        emit_function(fn, sc, slots)
        sc.emit(STORE, prim_slot[n])
    emit_function(expr_fn, sc, prim_slot)
    sc_ops, sc_args, sc_consts = sc.arrays()
    if max(_stack_depth(vec_ops), _stack_depth(sc_ops)) > MAX_STACK_DEPTH:
        raise Unsupported("expression too deep for the interpreter's stack")
    return StepProgram(
        vec_ops,
        vec_args,
        vec_consts,
        np.array(ranges, dtype=np.int64).reshape(-1, 2),
        np.array(phase, dtype=np.int64),
        np.array(reduce, dtype=np.int64),
        np.array(fslot, dtype=np.int64),
        sc_ops,
        sc_args,
        sc_consts,
        slots0,
        pack,
        np.zeros(0),
    )
