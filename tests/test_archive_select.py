"""recommend(): the PySR-like 'best' rule on hand-made fronts."""

from __future__ import annotations

import math

import pytest

from archive.entry import ArchiveEntry
from archive.select import combined_error, rank, recommend


def e(eid: str, complexity: int, **objectives: float) -> ArchiveEntry:
    return ArchiveEntry(
        id=eid,
        expression=eid,
        simplified=eid,
        complexity=complexity,
        constants=[],
        objectives={"complexity": complexity, **objectives},
        generation=0,
        primitives=[],
    )


def test_largest_log_drop_per_log_complexity_wins():
    front = [
        e("a", 1, step_mape=0.50),
        e("b", 3, step_mape=0.11),  # big drop from a: ln(0.5/0.11)/ln(3) = 1.38
        e("c", 6, step_mape=0.10),  # ln(1.2)/ln(2) = 0.26
        e("d", 12, step_mape=0.09),  # ln(0.1/0.09)/ln(2) = 0.15
    ]
    scores = {r.entry.id: r.score for r in rank(front)}
    assert scores["a"] == 0.0
    assert scores["b"] == pytest.approx(math.log(0.5 / 0.11) / math.log(3))
    assert recommend(front).id == "b"


def test_accuracy_gate_excludes_crude_models():
    front = [
        e("a", 1, step_mape=0.80),
        e("b", 2, step_mape=0.30),  # the steepest drop, but 3x the best error: not eligible
        e("c", 10, step_mape=0.12),
        e("d", 20, step_mape=0.10),
    ]
    # eligible: error <= 1.5 * 0.10 -> c and d; c's drop from b is the larger one
    assert recommend(front).id == "c"


def test_uses_worst_case_of_step_and_latency_errors():
    front = [
        e("good_steps_bad_e2e", 5, step_mape=0.05, e2e_error=0.40, ttft_error=0.1, itl_error=0.1),
        e("balanced", 8, step_mape=0.08, e2e_error=0.09, ttft_error=0.07, itl_error=-0.08),
        e("simple", 2, step_mape=0.30, e2e_error=0.35, ttft_error=0.2, itl_error=0.3),
    ]
    assert combined_error(front[0]) == 0.40
    assert combined_error(front[1]) == 0.09  # |signed| errors count by size
    assert recommend(front).id == "balanced"


def test_only_shared_objectives_are_compared():
    # "unreplayed" has no e2e_error: it must not win by lacking the hard objective
    front = [e("replayed", 4, step_mape=0.10, e2e_error=0.30), e("unreplayed", 4, step_mape=0.11)]
    ranked = rank(front)
    assert [r.entry.id for r in ranked] == ["replayed"]  # step_mape only: equal complexity, lower error
    assert recommend(front).id == "replayed"


def test_dominated_and_non_finite_entries_are_ignored():
    front = [
        e("a", 2, step_mape=0.4),
        e("worse_and_bigger", 5, step_mape=0.5),
        e("broken", 6, step_mape=float("nan")),
        e("b", 8, step_mape=0.1),
    ]
    assert [r.entry.id for r in rank(front)] == ["a", "b"]
    assert recommend(front).id == "b"


def test_ties_go_to_lower_complexity_then_id():
    # b and c both cut the error by 8/7 per doubling of complexity, and both pass the gate
    front = [e("a", 1, step_mape=0.2), e("b", 2, step_mape=0.175), e("c", 4, step_mape=0.153125)]
    scores = [r.score for r in rank(front)]
    assert scores[1] == pytest.approx(scores[2])
    assert recommend(front).id == "b"
    assert recommend(list(reversed(front))).id == "b"
    same = [e("zz", 3, step_mape=0.2), e("aa", 3, step_mape=0.2)]
    assert recommend(same).id == "aa"
    assert recommend(list(reversed(same))).id == "aa"


def test_single_entry_and_empty():
    assert recommend([e("only", 7, step_mape=0.3)]).id == "only"
    with pytest.raises(ValueError):
        recommend([])
    with pytest.raises(ValueError):
        recommend([e("x", 1, step_mape=float("inf"))])


def test_zero_error_is_finite_score():
    front = [e("a", 1, step_mape=0.2), e("exact", 4, step_mape=0.0)]
    assert recommend(front).id == "exact"
    assert all(math.isfinite(r.score) for r in rank(front))


def test_closed_loop_checked_entries_outrank_teacher_forced_ones():
    front = [
        e("tf", 5, step_mape=0.03, e2e_error=0.01),  # optimistic teacher-forced figures
        e("cl_a", 9, step_mape=0.04, e2e_error=0.30, closed_loop=1.0),
        e("cl_b", 12, step_mape=0.04, e2e_error=0.05, closed_loop=1.0),
    ]
    assert [r.entry.id for r in rank(front)] == ["cl_a", "cl_b"]
    assert recommend(front).id == "cl_b"


def lab_front(third: str, third_e2e: float, third_worst: float, runaway_e2e: float = 0.117) -> list[ArchiveEntry]:
    """As at the end of a search (seed 0 of a lab tree): a crude stable model, a runaway one
    (refitted without one model its held-out runs go into overload) and a third."""
    return [
        e("crude", 11, step_mape=0.05, e2e_error=0.34, transfer_error=0.15, transfer_error_worst=0.75),
        e("runaway", 17, step_mape=0.05, e2e_error=runaway_e2e, transfer_error=0.1, transfer_error_worst=1.0),
        e(third, 21, step_mape=0.04, e2e_error=third_e2e, transfer_error=0.063, transfer_error_worst=third_worst),
    ]


def test_a_model_whose_transfer_refit_runs_away_is_passed_over_for_a_stable_one():
    front = lab_front("stable", 0.099, 0.26)  # the runaway makes the bigger drop in error
    assert [r.entry.id for r in rank(front)] == ["crude", "stable"]
    assert recommend(front).id == "stable"


def test_a_runaway_does_not_shadow_a_slightly_less_accurate_stable_model():
    # without the gate, "stable" never reaches the front: a simpler entry has a lower error
    ranked = rank(lab_front("stable", 0.105, 0.26, runaway_e2e=0.100))
    assert [r.entry.id for r in ranked] == ["crude", "stable"]
    assert [r.eligible for r in ranked] == [False, True]  # 0.105 <= 1.25 x the runaway's 0.100
    assert recommend(lab_front("stable", 0.105, 0.26, runaway_e2e=0.100)).id == "stable"


def test_the_gate_never_ships_a_crude_model_and_leaves_old_archives_alone():
    front = lab_front("runaway2", 0.099, 1.0)
    # every model within the accuracy gate runs away somewhere: the gate has nothing to
    # offer but a crude model, so every entry takes part and the score decides (flagged)
    ranked = rank(front)
    assert [r.entry.id for r in ranked] == ["crude", "runaway", "runaway2"]
    assert [r.runaway for r in ranked] == [False, True, True]
    assert recommend(front).id == "runaway"
    # entries without the figure (archives from before the gate, or a mix) are not gated
    del front[1].objectives["transfer_error_worst"]
    front[2].objectives["transfer_error_worst"] = 0.2
    assert recommend(front).id == "runaway"
    for x in front:
        x.objectives.pop("transfer_error_worst", None)
    assert recommend(front).id == "runaway"
