"""The search: multi-objective DEAP genetic programming over physics primitives.

NSGA-II (mu + lambda) on (training cycle-time error, complexity), plus the replayed
latency error when experiments are given. Candidates are scored as picklable programs
(``primitives.language``), memoised by canonical form (``evolve.evaluator``); their
additive coefficients are fitted by least squares (``fitness.scoring``). Bloat is held
by static height and size limits (``evolve.toolbox``) and by complexity as an
objective. The same seed and data give the same archive.

A step-only search also keeps one candidate per objective vector: without it the population
fills with programs that fit alike (``x`` beside ``x + 0*y``), the front shrinks to three to
eight models and most seeds stall on a worse structure (docs/RESULTS.md, "One candidate per
objective vector"). With replayed experiments it does not: there every new candidate costs
closed-loop simulations, and the wider search took three times as long for the same terms.
"""

from __future__ import annotations

import hashlib
import pickle
import random
from dataclasses import dataclass, field
from pathlib import Path

from deap import tools

from evolve.config import RunConfig
from evolve.evaluator import Evaluator
from evolve.toolbox import build_pset, individual_class, make_toolbox, program_to_tree, seed_trees, tree_to_program
from fitness.scoring import FitnessContext, Score
from primitives.errors import InputError
from primitives.files import atomic_write_bytes
from primitives.language import Program, canonical

# --- search state ----------------------------------------------------------------
CHECKSUM_TAG = b"\nstepsynth-sha256:"  # after the pickle, which pickle.load stops before


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


# What the search minimises: step error, replay error, how the constants transfer
# (``fitness.transfer``: with replayed experiments of two or more workloads or models), size.
OBJECTIVE_NAMES = {
    True: ("train_error", "replay_error", "transfer_error", "complexity"),
    False: ("train_error", "complexity"),
}


def objectives_of(score: Score, with_replay: bool) -> tuple[float, ...]:
    return tuple(float(getattr(score, name)) for name in OBJECTIVE_NAMES[with_replay])


def search_error(score: Score) -> float:
    """One number to rank candidates of equal complexity."""
    return score.train_error + score.replay_error


def pareto_front(items: list[tuple[Program, Score]], with_replay: bool) -> list[tuple[Program, Score]]:
    """Non-dominated candidates (minimising every objective), sorted by complexity."""
    objs = [objectives_of(s, with_replay) for _, s in items]
    keep = []
    for i, oi in enumerate(objs):
        dominated = any(
            all(a <= b for a, b in zip(oj, oi, strict=True)) and any(a < b for a, b in zip(oj, oi, strict=True))
            for j, oj in enumerate(objs)
            if j != i
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
        self.distinct_objectives = not self.with_replay  # see the module's docstring
        self.Individual = individual_class(len(OBJECTIVE_NAMES[self.with_replay]))
        self.pset = build_pset(primitive_names)
        self.toolbox = make_toolbox(self.pset, config.max_depth, config.max_size)
        self.state = SearchState()
        self.entries: dict = {}  # archive entries already built (see evolve.records)

    # -- conversions -----------------------------------------------------------
    def _tree(self, program: Program):
        return program_to_tree(program, self.pset, self.Individual)

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
        for p, s in zip(programs, scores, strict=True):
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
        inds, seen = [], set()
        for p, s in zip(progs, scores, strict=True):
            values = objectives_of(s, self.with_replay)
            phenotype = tuple(round(v, 9) for v in values)  # the same fit to rounding
            if self.distinct_objectives and phenotype in seen:
                continue
            seen.add(phenotype)
            ind = self._tree(p)
            ind.fitness.values = values
            inds.append(ind)
        chosen = tools.selNSGA2(inds, min(k, len(inds)))
        chosen_programs = [tree_to_program(t) for t in chosen]
        # keep a full population: where duplicates shrank it, top it up from the candidates in
        # their order (repeated fits and chosen ones included)
        while len(chosen_programs) < k and progs:
            chosen_programs.append(progs[len(chosen_programs) % len(progs)])
        return chosen_programs

    def step(self) -> None:
        """One generation: variation, scoring, NSGA-II survival."""
        random.setstate(self.state.python_random_state)
        parents = [self._tree(p) for p in self.state.population]
        for ind, p in zip(parents, self.state.population, strict=True):
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
        """Continue under refreshed replay rows: rescore the population and the hall. An
        interrupt while rescoring leaves the context and the hall as they were (the run then
        archives and checkpoints them), not a hall half rescored under new rows."""
        programs = [p for p, _ in self.state.hall.values()] + list(self.state.population)
        old_hall, old_scores = self.state.hall, self.evaluator.scores_kept()
        self.evaluator.reset(ctx)
        try:
            scores = self.evaluator.score(programs)
            self.state.hall = {}
            for p, s in zip(programs, scores, strict=True):
                self._offer(p, s, self.state.generation)
        except BaseException:
            # the hall's scores are read from the memo: both as they were; the run is stopping
            self.state.hall = old_hall
            self.evaluator.restore(old_scores)
            raise
        self.ctx = ctx

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

    def save_checkpoint(self, path: Path, owner: dict | None = None) -> None:
        """Atomic: a killed run leaves the previous checkpoint whole. OWNER (run token, data
        fingerprint) says which run it belongs to; a SHA-256 trailer proves it whole."""
        payload = {
            "config": self.config.to_dict(),
            "state": self.state,
            "names": self.names,
            "owner": dict(owner or {}),
            "scored_copies": self.evaluator.scored_copies,  # which copy of each form was scored
        }
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        atomic_write_bytes(path, data + CHECKSUM_TAG + hashlib.sha256(data).hexdigest().encode())

    @staticmethod
    def read_checkpoint(path: Path, owner: dict | None = None) -> dict:
        """The checkpoint's payload, verified: whole (its SHA-256), and of the run OWNER describes."""
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise InputError(path, None, f"cannot read the checkpoint ({exc.strerror or exc})") from None
        data, tag, digest = raw.rpartition(CHECKSUM_TAG)
        if not tag:
            raise InputError(
                path, None, "the checkpoint is damaged or from an older version (no checksum); cannot resume from it"
            )
        if hashlib.sha256(data).hexdigest().encode() != digest:
            raise InputError(path, None, "the checkpoint is damaged (checksum mismatch); cannot resume from it")
        try:
            payload = pickle.loads(data)
        except Exception as exc:  # a checksummed pickle from another program version
            raise InputError(path, None, f"unreadable checkpoint ({type(exc).__name__}); cannot resume") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("state"), SearchState):
            raise InputError(path, None, "not a checkpoint of this program; cannot resume from it")
        for key, want in (owner or {}).items():
            got = payload.get("owner", {}).get(key)
            if got != want and key == "fingerprint":  # same run, other data: say so, not "another run"
                raise InputError(
                    path,
                    key,
                    f"the run's data changed since it was made ({got!r} then, {want!r} now): a step trace or"
                    " an experiment was added, removed or changed; restore them to resume, or start a new run",
                )
            if got != want:
                raise InputError(path, key, f"the checkpoint belongs to another run ({got!r}, this run: {want!r})")
        return payload

    @staticmethod
    def peek_checkpoint(path: Path, owner: dict | None = None) -> SearchState:
        return Search.read_checkpoint(path, owner)["state"]

    def load_checkpoint(self, path: Path, owner: dict | None = None) -> None:
        payload = self.read_checkpoint(path, owner)
        self.state = payload["state"]
        # scores are deterministic: rescore the population and hall to refill the memo, each form
        # as the copy the interrupted run scored (a checkpoint from before scored_copies has none)
        self.evaluator.scored_copies.update(payload.get("scored_copies") or {})
        self.evaluator.score(list(self.state.population) + [p for p, _ in self.state.hall.values()])
