"""The DEAP plumbing of the search: primitive set, individuals, variation operators.

Candidates travel as picklable programs (``primitives.language.Program``); DEAP trees
exist only for variation and selection. Everything here is module-level so that it
pickles. Every draw comes from Python's global ``random`` (seeded by the search).
"""

from __future__ import annotations

import random

from deap import base, creator, gp

from primitives.language import OPERATORS, Program
from seeds import seeds_for

CONSTANT_NAME = "stepsynth_const"


def ephemeral_constant() -> float:
    """A constant spread over five decades, rounded to 3 significant digits."""
    value = 10.0 ** random.uniform(-2.0, 3.0)
    return float(f"{value:.3g}")


def build_pset(primitive_names: list[str]) -> gp.PrimitiveSet:
    pset = gp.PrimitiveSet("STEP", len(primitive_names))
    pset.renameArguments(**{f"ARG{i}": name for i, name in enumerate(primitive_names)})
    for op in OPERATORS.values():
        pset.addPrimitive(op.numpy_fn, op.arity, name=op.name)
    pset.addEphemeralConstant(CONSTANT_NAME, ephemeral_constant)
    return pset


def individual_class(n_objectives: int) -> type:
    """The DEAP individual (a tree minimising ``n_objectives`` objectives), created once."""
    name = f"StepFitness{n_objectives}"
    if not hasattr(creator, name):
        creator.create(name, base.Fitness, weights=(-1.0,) * n_objectives)
    ind = f"StepTree{n_objectives}"
    if not hasattr(creator, ind):
        creator.create(ind, gp.PrimitiveTree, fitness=getattr(creator, name))
    return getattr(creator, ind)


def seed_trees(primitive_names: list[str], pset: gp.PrimitiveSet) -> list[gp.PrimitiveTree]:
    """The known models of ``seeds/`` that this run's primitives support, as trees."""
    return [gp.PrimitiveTree.from_string(text, pset) for _, text in sorted(seeds_for(primitive_names).items())]


def tree_to_program(tree: gp.PrimitiveTree) -> Program:
    out = []
    for node in tree:
        if isinstance(node, gp.Primitive):
            out.append(("op", node.name))
        elif isinstance(node.value, str):
            out.append(("var", node.value))
        else:
            out.append(("const", float(node.value)))
    return tuple(out)


def program_to_tree(program: Program, pset: gp.PrimitiveSet, individual: type):
    """The DEAP individual of a program (constants as ephemeral nodes of this pset)."""
    nodes = []
    args = {name: t for name, t in pset.mapping.items()}
    for kind, value in program:
        if kind == "op":
            nodes.append(pset.mapping[value])
        elif kind == "var":
            nodes.append(args[value])
        else:
            const_cls = pset.mapping.get(CONSTANT_NAME) or next(
                t for t in pset.terminals[object] if isinstance(t, type)
            )
            c = const_cls()
            c.value = float(value)
            nodes.append(c)
    return individual(nodes)


def _mut_insert_or_shrink(ind, pset):
    """Alternate small structural moves: wrap a node in a new operator, or shrink one."""
    if random.random() < 0.5:
        return gp.mutInsert(ind, pset)
    return gp.mutShrink(ind)


def _mutate(ind, pset, expr_mut):
    r = random.random()
    if r < 0.35:
        return gp.mutUniform(ind, expr=expr_mut, pset=pset)
    if r < 0.6:
        return gp.mutNodeReplacement(ind, pset=pset)
    if r < 0.8:
        return gp.mutEphemeral(ind, mode="one")
    return _mut_insert_or_shrink(ind, pset)


def make_toolbox(pset: gp.PrimitiveSet, max_depth: int, max_size: int) -> base.Toolbox:
    """Initial trees, crossover and mutation, held within static height and size limits."""
    tb = base.Toolbox()
    tb.register("expr", gp.genHalfAndHalf, pset=pset, min_=1, max_=4)
    tb.register("expr_mut", gp.genFull, min_=0, max_=2)
    tb.register("mate", gp.cxOnePoint)
    tb.register("mutate", _mutate, pset=pset, expr_mut=tb.expr_mut)
    limit_h = gp.staticLimit(key=lambda t: t.height, max_value=max_depth)
    limit_s = gp.staticLimit(key=len, max_value=max_size)
    for op in ("mate", "mutate"):
        tb.decorate(op, limit_h)
        tb.decorate(op, limit_s)
    return tb
