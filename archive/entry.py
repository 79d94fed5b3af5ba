"""One archived model: an evolved step-time expression with its fitted terms and scores."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field


def entry_id_for(simplified_expression: str) -> str:
    """Stable id derived from the simplified expression's text."""
    return hashlib.sha1(simplified_expression.encode()).hexdigest()[:12]


@dataclass
class ArchiveEntry:
    id: str
    expression: str  # readable infix, parsable by primitives.language.parse_infix (sympy)
    simplified: str  # sympy-simplified infix
    complexity: int
    constants: list[float]  # fitted coefficients, in the order they appear in `expression`
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
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
