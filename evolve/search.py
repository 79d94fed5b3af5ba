"""The search: multi-objective DEAP genetic programming over physics primitives.

NSGA-II (mu + lambda) on (training cycle-time error, complexity), plus the replayed
latency error when experiments are given. Candidates are scored in a joblib pool as
picklable programs (``primitives.language``), memoised by canonical form; their
additive coefficients are fitted by least squares (``fitness.scoring``). Bloat is held
by static height and size limits and by complexity as an objective. The same seed and
data give the same archive.
"""
from __future__ import annotations

import os
import pickle
import random
from dataclasses import dataclass, field
from pathlib import Path

from deap import base, creator, gp, tools

from archive.entry import ArchiveEntry, entry_id_for
from fitness.scoring import FitnessContext, Score, score_many
from seeds import seeds_for

from .config import RunConfig
from primitives.language import (
    OPERATORS,
    Program,
    canonical,
    linear_model_sympy,
    simplify_expression,
    to_infix,
    variables,
)

CHECKPOINT_NAME = "checkpoint.pkl"
ARCHIVE_NAME = "archive.sqlite"


# --- DEAP plumbing (module-level so that everything pickles) ---------------------
def ephemeral_constant() -> float:
    """A constant spread over five decades, rounded to 3 significant digits."""
    value = 10.0 ** random.uniform(-2.0, 3.0)
    return float(f"{value:.3g}")


def build_pset(primitive_names: list[str]) -> gp.PrimitiveSet:
    pset = gp.PrimitiveSet("STEP", len(primitive_names))
    pset.renameArguments(**{f"ARG{i}": name for i, name in enumerate(primitive_names)})
    for op in OPERATORS.values():
        pset.addPrimitive(op.numpy_fn, op.arity, name=op.name)
    pset.addEphemeralConstant("stepsynth_const", ephemeral_constant)
    return pset


def _ensure_creator(n_objectives: int) -> None:
    name = f"StepFitness{n_objectives}"
    if not hasattr(creator, name):
        creator.create(name, base.Fitness, weights=(-1.0,) * n_objectives)
    ind = f"StepTree{n_objectives}"
    if not hasattr(creator, ind):
        creator.create(ind, gp.PrimitiveTree, fitness=getattr(creator, name))


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


# --- search state ----------------------------------------------------------------
@dataclass
class SearchState:
    generation: int = 0
    population: list[Program] = field(default_factory=list)
    # best candidate at each complexity, over the whole run: complexity -> (program, generation)
    hall: dict[int, tuple[Program, int]] = field(default_factory=dict)
    first_seen: dict[str, int] = field(default_factory=dict)  # canonical -> generation found
    python_random_state: object = None
    evaluations: int = 0
    elapsed_s: float = 0.0
    # (expression, overheads) of the model whose closed-loop trajectories the replay uses
    replay_model: tuple[str, dict] | None = None


_WORKER_CONTEXTS: dict[str, FitnessContext] = {}


def score_chunk_from_file(context_path: str, programs: list[Program]) -> list[Score]:
    """Worker side of the pool: load the fitness context once per worker, then score."""
    ctx = _WORKER_CONTEXTS.get(context_path)
    if ctx is None:
        with open(context_path, "rb") as fh:
            ctx = pickle.load(fh)
        _WORKER_CONTEXTS.clear()
        _WORKER_CONTEXTS[context_path] = ctx
    return score_many(programs, ctx)


class Evaluator:
    """Memoised, parallel scoring of programs.

    The fitness context (tens of MB of columns) reaches each worker once: loky workers
    read it from a pickle in a temporary directory; Dask workers get it scattered.
    """

    def __init__(self, ctx: FitnessContext, jobs: int, backend: str = "loky", scheduler: str | None = None):
        self.ctx = ctx
        self.jobs = max(1, int(jobs))
        self.backend = backend
        self.scheduler = scheduler
        self.memo: dict[str, Score] = {}
        self._parallel = None
        self._client = None

    def __enter__(self):
        import tempfile

        from joblib import Parallel

        self._tmp = None
        if self.jobs > 1 or self.backend == "dask":
            if self.backend == "dask":
                from joblib import parallel_config

                from .cluster import dask_client

                self._client = dask_client(self.scheduler, self.jobs)
                self._cfg = parallel_config(backend="dask", scatter=[self.ctx])
                self._cfg.__enter__()
                self._parallel = Parallel(n_jobs=-1)
            else:
                self._tmp = tempfile.TemporaryDirectory(prefix="stepsynth-ctx-")
                self._ctx_path = os.path.join(self._tmp.name, "context.pkl")
                with open(self._ctx_path, "wb") as fh:
                    pickle.dump(self.ctx, fh, protocol=pickle.HIGHEST_PROTOCOL)
                self._parallel = Parallel(n_jobs=self.jobs, backend="loky")
            self._parallel.__enter__()
        return self

    def __exit__(self, *exc):
        if self._parallel is not None:
            self._parallel.__exit__(*exc)
        if self._client is not None:
            self._cfg.__exit__(*exc)
            self._client.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        return False

    def reset(self, ctx: FitnessContext) -> None:
        """Score against a new context (refreshed trajectories): new pool, empty memo."""
        self.__exit__(None, None, None)
        self.ctx = ctx
        self.memo.clear()
        self._parallel = None
        self._client = None
        self.__enter__()

    def score(self, programs: list[Program]) -> list[Score]:
        keys = [canonical(p) for p in programs]
        todo: dict[str, Program] = {}
        for k, p in zip(keys, programs):
            if k not in self.memo and k not in todo:
                todo[k] = p
        if todo:
            items = list(todo.items())
            progs = [p for _, p in items]
            if self._parallel is None:
                scores = score_many(progs, self.ctx)
            else:
                from joblib import delayed

                n_chunks = min(len(progs), self.jobs * 4)
                chunks = [progs[i::n_chunks] for i in range(n_chunks)]
                if self._client is not None:
                    from .cluster import preserve_random_state  # dask consumes global random

                    with preserve_random_state():
                        results = self._parallel(delayed(score_many)(c, self.ctx) for c in chunks)
                else:
                    results = self._parallel(delayed(score_chunk_from_file)(self._ctx_path, c) for c in chunks)
                scores = [None] * len(progs)
                for i, res in enumerate(results):
                    scores[i::n_chunks] = res
            for (k, _), s in zip(items, scores):
                self.memo[k] = s
        return [self.memo[k] for k in keys]


def objectives_of(score: Score, with_replay: bool) -> tuple[float, ...]:
    if with_replay:
        return (score.train_error, score.replay_error, float(score.complexity))
    return (score.train_error, float(score.complexity))


def search_error(score: Score) -> float:
    """One number to rank candidates of equal complexity."""
    return score.train_error + score.replay_error


def pareto_front(items: list[tuple[Program, Score]], with_replay: bool) -> list[tuple[Program, Score]]:
    """Non-dominated candidates (minimising every objective), sorted by complexity."""
    objs = [objectives_of(s, with_replay) for _, s in items]
    keep = []
    for i, oi in enumerate(objs):
        dominated = any(
            all(a <= b for a, b in zip(oj, oi)) and any(a < b for a, b in zip(oj, oi)) for j, oj in enumerate(objs) if j != i
        )
        if not dominated and items[i][1].ok:
            keep.append(items[i])
    keep.sort(key=lambda it: (it[1].complexity, search_error(it[1])))
    return keep


class Search:
    """One run of the genetic program; resumable from its checkpoint."""

    def __init__(self, config: RunConfig, ctx: FitnessContext, primitive_names: list[str], evaluator: Evaluator):
        self.config = config
        self.ctx = ctx
        self.names = primitive_names
        self.evaluator = evaluator
        self.with_replay = ctx.replay is not None
        n_obj = 3 if self.with_replay else 2
        _ensure_creator(n_obj)
        self.Individual = getattr(creator, f"StepTree{n_obj}")
        self.pset = build_pset(primitive_names)
        tb = base.Toolbox()
        tb.register("expr", gp.genHalfAndHalf, pset=self.pset, min_=1, max_=4)
        tb.register("expr_mut", gp.genFull, min_=0, max_=2)
        tb.register("mate", gp.cxOnePoint)
        tb.register("mutate", _mutate, pset=self.pset, expr_mut=tb.expr_mut)
        limit_h = gp.staticLimit(key=lambda t: t.height, max_value=config.max_depth)
        limit_s = gp.staticLimit(key=len, max_value=config.max_size)
        for op in ("mate", "mutate"):
            tb.decorate(op, limit_h)
            tb.decorate(op, limit_s)
        self.toolbox = tb
        self.state = SearchState()
        self.entries: dict = {}  # archive entries already built (see evolve.run)

    # -- conversions -----------------------------------------------------------
    def _tree(self, program: Program):
        nodes = []
        args = {name: t for name, t in self.pset.mapping.items()}
        for kind, value in program:
            if kind == "op":
                nodes.append(self.pset.mapping[value])
            elif kind == "var":
                nodes.append(args[value])
            else:
                const_cls = self.pset.mapping.get("stepsynth_const") or next(
                    t for t in self.pset.terminals[object] if isinstance(t, type)
                )
                c = const_cls()
                c.value = float(value)
                nodes.append(c)
        return self.Individual(nodes)

    def _seed_trees(self) -> list:
        return [self.Individual(t) for t in seed_trees(self.names, self.pset)]

    # -- the loop --------------------------------------------------------------
    def initialise(self) -> None:
        random.seed(self.config.seed)
        pop = self._seed_trees()
        while len(pop) < self.config.population:
            pop.append(self.Individual(self.toolbox.expr()))
        programs = [tree_to_program(t) for t in pop]
        self._evaluate_and_record(programs, generation=0)
        self.state.population = self._select(programs, self.config.population)
        self.state.python_random_state = random.getstate()

    def _evaluate_and_record(self, programs: list[Program], generation: int) -> list[Score]:
        scores = self.evaluator.score(programs)
        self.state.evaluations += len(programs)
        for p, s in zip(programs, scores):
            self._offer(p, s, generation)
        return scores

    def _offer(self, program: Program, score: Score, generation: int) -> None:
        """Keep the candidate if it is the best seen at its complexity."""
        if not score.ok:
            return
        key = canonical(program)
        self.state.first_seen.setdefault(key, generation)
        best = self.state.hall.get(score.complexity)
        if best is None or search_error(score) < search_error(self.evaluator.memo[canonical(best[0])]):
            self.state.hall[score.complexity] = (program, self.state.first_seen[key])

    def _select(self, programs: list[Program], k: int) -> list[Program]:
        uniq: dict[str, Program] = {}
        for p in programs:
            uniq.setdefault(canonical(p), p)
        progs = list(uniq.values())
        scores = self.evaluator.score(progs)
        inds = []
        for p, s in zip(progs, scores):
            ind = self._tree(p)
            ind.fitness.values = objectives_of(s, self.with_replay)
            inds.append(ind)
        chosen = tools.selNSGA2(inds, min(k, len(inds)))
        chosen_programs = [tree_to_program(t) for t in chosen]
        # keep a full population: refill from the best of the rest if duplicates shrank it
        while len(chosen_programs) < k and progs:
            chosen_programs.append(progs[len(chosen_programs) % len(progs)])
        return chosen_programs

    def step(self) -> None:
        """One generation: variation, scoring, NSGA-II survival."""
        random.setstate(self.state.python_random_state)
        parents = [self._tree(p) for p in self.state.population]
        for ind, p in zip(parents, self.state.population):
            ind.fitness.values = objectives_of(self.evaluator.memo[canonical(p)], self.with_replay)
        offspring = []
        n = self.config.population
        while len(offspring) < n:
            r = random.random()
            if r < 0.6:
                a = self.toolbox.clone(random.choice(parents))
                b = self.toolbox.clone(random.choice(parents))
                a, b = self.toolbox.mate(a, b)
                offspring.extend([a, b])
            else:
                (m,) = self.toolbox.mutate(self.toolbox.clone(random.choice(parents)))
                offspring.append(m)
        gen = self.state.generation + 1
        programs = [tree_to_program(t) for t in offspring[:n]]
        self._evaluate_and_record(programs, generation=gen)
        self.state.population = self._select(self.state.population + programs, n)
        self.state.generation = gen
        self.state.python_random_state = random.getstate()

    def replace_context(self, ctx: FitnessContext) -> None:
        """Continue under refreshed replay rows: rescore the population and the hall."""
        self.ctx = ctx
        self.evaluator.reset(ctx)
        programs = [p for p, _ in self.state.hall.values()] + list(self.state.population)
        self.state.hall = {}
        for p, s in zip(programs, self.evaluator.score(programs)):
            self._offer(p, s, self.state.generation)

    def best_item(self) -> tuple[Program, Score]:
        """The candidate with the lowest combined error (drives trajectory refreshes)."""
        return min(self.hall_items(), key=lambda it: (search_error(it[1]), it[1].complexity))

    # -- results ---------------------------------------------------------------
    def hall_items(self) -> list[tuple[Program, Score]]:
        return [(p, self.evaluator.memo[canonical(p)]) for _, (p, _) in sorted(self.state.hall.items())]

    def front(self) -> list[tuple[Program, Score]]:
        return pareto_front(self.hall_items(), self.with_replay)

    def best_error(self) -> float:
        items = self.hall_items()
        return min((s.objectives.get("step_mape", s.train_error) for _, s in items), default=float("nan"))

    def save_checkpoint(self, run_dir: Path) -> None:
        """Atomic: write a temp file, fsync, then rename over the old checkpoint."""
        payload = {
            "config": self.config.to_dict(),
            "state": self.state,
            "names": self.names,
        }
        tmp = run_dir / (CHECKPOINT_NAME + ".tmp")
        with open(tmp, "wb") as fh:
            pickle.dump(payload, fh, protocol=pickle.HIGHEST_PROTOCOL)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, run_dir / CHECKPOINT_NAME)

    @staticmethod
    def peek_checkpoint(run_dir: Path) -> SearchState:
        with open(run_dir / CHECKPOINT_NAME, "rb") as fh:
            return pickle.load(fh)["state"]

    def load_checkpoint(self, run_dir: Path) -> None:
        with open(run_dir / CHECKPOINT_NAME, "rb") as fh:
            payload = pickle.load(fh)
        self.state = payload["state"]
        # scores are deterministic: rescore the population and hall to refill the memo
        self.evaluator.score(list(self.state.population) + [p for p, _ in self.state.hall.values()])


def entry_from(program: Program, score: Score, generation: int, meta: dict, simplify: bool = False) -> ArchiveEntry:
    """An archive entry. Its id comes from the constant-folded expression, so it is stable
    whether or not the (slow) sympy simplification has run; ``simplify`` adds that form,
    which the run does once, for its final front."""
    expr = linear_model_sympy(score.terms, score.coefficients, score.intercept)
    folded_text = to_infix(expr.evalf())
    simplified_text = to_infix(simplify_expression(expr)) if simplify else folded_text
    consts = [score.intercept] + list(score.coefficients)
    return ArchiveEntry(
        id=entry_id_for(folded_text),
        expression=to_infix(expr),
        simplified=simplified_text,
        complexity=int(score.complexity),
        constants=[float(c) for c in consts],
        objectives=dict(score.objectives),
        generation=int(generation),
        primitives=variables(program),
        overheads=dict(score.overheads),
        per_experiment=score.per_experiment,
        on_front=True,
        run_id=meta.get("run_id", ""),
        dataset_fingerprint=meta.get("fingerprint", ""),
        seed=int(meta.get("seed", 0)),
        run_config=meta.get("config", {}),
    )


def run_search(config: RunConfig, ui):
    """Entry point of `python -m evolve run` (kept here for the CLI; see evolve.run)."""
    from .run import run_search as _run

    return _run(config, ui)
