"""Archive records of the search: entries built from scored candidates, fronts written to the store."""

from __future__ import annotations

from archive.entry import ArchiveEntry, entry_id_for, simplest_per_id
from archive.store import ArchiveStore
from fitness.scoring import Score
from primitives.language import Program, canonical, linear_model_sympy, simplify_expression, to_infix, variables


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


def entry_for(search, program: Program, score: Score, meta: dict, simplify: bool = False) -> ArchiveEntry:
    """Archive entries are built once per candidate and context (and once more simplified)."""
    key = (canonical(program), id(search.ctx), simplify)
    if key not in search.entries:
        search.entries[key] = entry_from(program, score, search.state.first_seen.get(key[0], 0), meta, simplify)
    return search.entries[key]


def best_entries(search, meta: dict) -> list[ArchiveEntry]:
    """The best entry at each complexity over the whole run."""
    return [entry_for(search, p, s, meta) for p, s in search.hall_items()]


def record_front(store: ArchiveStore, search, meta: dict, final: bool = False) -> list[ArchiveEntry]:
    """Write the current front and the best entry at each complexity, in one transaction.

    The final record adds the sympy-simplified form to the front's entries."""
    front = simplest_per_id(entry_for(search, p, s, meta, simplify=final) for p, s in search.front())
    best = best_entries(search, meta)
    stats = {"evaluations": search.state.evaluations, "best_error": search.best_error()}
    store.record_generation(meta["run_id"], search.state.generation, front, best, stats)
    return front
