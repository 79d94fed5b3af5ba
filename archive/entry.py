"""One archived model: an evolved step-time expression with its fitted terms and scores."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

from primitives.infix_syntax import check_infix


def entry_id_for(simplified_expression: str) -> str:
    """Stable id derived from the simplified expression's text."""
    return hashlib.sha1(simplified_expression.encode()).hexdigest()[:12]


def simplest_per_id(entries) -> list:
    """ENTRIES with one entry per id, in their order: two trees that fold to the same
    expression (one id) are one model, kept at its smallest complexity."""
    kept: dict = {}
    for e in entries:
        if e.id not in kept or e.complexity < kept[e.id].complexity:
            kept[e.id] = e
    return list(kept.values())


@dataclass
class ArchiveEntry:
    id: str
    expression: str  # readable infix, parsable by primitives.language.parse_infix (sympy)
    simplified: str  # sympy-simplified infix
    complexity: int
    constants: list[float]  # the tree's fitted intercept, then each of its terms' coefficients (0s too)
    objectives: dict[str, float]  # step_mape (validation, fraction), complexity, e2e_error, ttft_error, itl_error, ...
    generation: int  # generation the expression was first found in
    primitives: list[str]  # GP terminals the expression uses
    # the non-step latency terms by name, µs (see fitness.sim.latency_model)
    overheads: dict[str, float] = field(default_factory=dict)
    per_experiment: dict[str, dict[str, float]] = field(default_factory=dict)  # experiment -> metric -> value
    on_front: bool = True
    run_id: str = ""
    dataset_fingerprint: str = ""
    seed: int = 0
    run_config: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ArchiveEntry":
        """The entry D describes; ValueError naming the field where D holds something else
        (a damaged archive or JSON file must not reach the commands that read entries)."""
        for name, kinds in _FIELD_TYPES.items():
            if name in d:
                _each([d[name]], name, kinds, what="")
        _each(d.get("constants", []), "constants", (int, float))
        _each(d.get("primitives", []), "primitives", (str,))
        _each(d.get("objectives", {}).values(), "objectives", (int, float, type(None)))
        _each(d.get("overheads", {}).values(), "overheads", (int, float))
        _each(d.get("per_experiment", {}).values(), "per_experiment", (dict,))
        try:  # the text is evaluated by sympy and printed as Go later: anything but arithmetic is damage
            check_infix(d.get("expression", "0"))
        except ValueError as exc:
            raise ValueError(f"expression: {exc}: {d['expression']!r:.60}") from None
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


# what each stored field may hold (bool is an int to Python, so it is checked apart)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "expression": (str,),
    "simplified": (str, type(None)),
    "complexity": (int,),
    "constants": (list,),
    "objectives": (dict,),
    "generation": (int,),
    "primitives": (list,),
    "overheads": (dict,),
    "per_experiment": (dict,),
    "on_front": (bool,),
    "run_id": (str,),
    "dataset_fingerprint": (str,),
    "seed": (int,),
    "run_config": (dict,),
}


def _is(value: object, kinds: tuple[type, ...]) -> bool:
    return isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))


def _each(values, name: str, kinds: tuple[type, ...], what: str = " items") -> None:
    """ValueError naming NAME unless every one of VALUES is of one of KINDS."""
    for v in values:
        if not _is(v, kinds):
            raise ValueError(f"{name}: expected {' or '.join(k.__name__ for k in kinds)}{what}, got {v!r:.60}")


def check_run_config(config: dict) -> None:
    """ValueError naming the field where a run's stored configuration holds what the commands
    that price its models with read (the seed of its draws, its efficiency bounds) but cannot
    use; its step scatter is checked by ``fitness.step_scatter.StepScatter.from_dict``. Its
    inputs' paths are not checked: data that moved or a damaged path only means the
    deployments it saw cannot be told (``archive.rundir.fitted_deployments``)."""

    def number(name: str, value: object) -> None:
        if not _is(value, (int, float)) or value != value or abs(value) == float("inf"):
            raise ValueError(f"{name}: expected a number, got {value!r:.60}")

    if config.get("seed") is not None and not (_is(config["seed"], (int,)) and config["seed"] >= 0):
        raise ValueError(f"seed: expected a non-negative integer, got {config['seed']!r:.60}")
    bounds = config.get("efficiency_bounds")
    if bounds is not None:
        if not (isinstance(bounds, list) and len(bounds) == 2):
            raise ValueError(f"efficiency_bounds: expected [LO, HI], got {bounds!r:.60}")
        for value in bounds:
            number("efficiency_bounds", value)
    for key in ("efficiency_caps", "efficiency_floors"):
        found = config.get(key)
        if found is not None and not isinstance(found, dict):
            raise ValueError(f"{key}: expected a mapping of primitive to a number, got {found!r:.60}")
        for name, value in (found or {}).items():
            number(f"{key}.{name}", value)
