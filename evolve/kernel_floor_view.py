"""Where a model holds beyond its data: its step time against the measured kernels on every
catalog deployment (``archive show``'s table, and a note from ``archive best`` and
``export-go`` where it prices steps faster than their kernels).

A fit sees only its data's deployments; the Go export for BLIS (``--blis``) ships a model
for every catalog model at TP 1, 2, 4 and 8 (``--out`` bakes in one). On each,
``fitness.physics_check.kernel_floor_by_deployment`` gives the lowest ratio, over the
physics probes, of the model's step time to the sum of the measured kernels the step runs
(matmuls, decode and prefill attention; where no table was measured at that head layout
and TP, as at TP 8, the nearest one scaled by KV heads per GPU: ``primitives.kernels``).
Below 1, the model is faster than its own kernels there: it cannot be right on that
deployment, whatever it scored where it was fitted (a constant that stands in for weight
streaming does this). 1 or more is necessary, not sufficient.
"""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from archive.entry import ArchiveEntry

if TYPE_CHECKING:  # the CLI imports this module at start-up: sympy and numpy come with the first use
    from primitives.deployment import Deployment, DeploymentResolver

FloorRatios = list[tuple["Deployment", float | None]]


def run_resolver(entry: ArchiveEntry, fallback: DeploymentResolver) -> DeploymentResolver:
    """The resolver ENTRY's run used (its model configs, datasheet and kernel tables, as
    recorded in ``run_config``) where those paths are still there, else FALLBACK."""
    from primitives.deployment import DeploymentResolver

    rc = entry.run_config or {}
    paths = [rc.get(k) for k in ("model_configs", "gpu_datasheet", "kernels")]
    if not any(paths) or not all(Path(v).exists() for v in paths if v):
        return fallback
    return DeploymentResolver.from_options(*(Path(v) if v else None for v in paths))


def catalog_floor(
    entry: ArchiveEntry,
    run_dir: Path | None,
    resolver: DeploymentResolver,
    primary: Deployment | None = None,
    primary_only: bool = False,
) -> FloorRatios | None:
    """The kernel-floor ratio of ENTRY on every catalog deployment on the GPU of PRIMARY
    (default: the run's first deployment; PRIMARY_ONLY: that one alone), with the run's own
    model configs and kernel tables where they are still found. None where it cannot be
    told: the run's data is gone, an expression of other primitives, anything amiss (a
    courtesy, never an error)."""
    import numpy as np

    from fitness.physics_check import kernel_floor_by_deployment
    from primitives.language import parse_infix
    from primitives.registry import PRIMITIVE_BY_NAME

    try:
        if not {s.name for s in parse_infix(entry.expression).free_symbols} <= PRIMITIVE_BY_NAME.keys():
            return None  # an archive of older primitives: nothing to price it with
        resolver = run_resolver(entry, resolver)
        if primary is None:
            from translate_go.export import default_deployment

            primary = default_deployment(entry, resolver, run_dir=run_dir)
        deployments = [primary] if primary_only else resolver.catalog_deployments(primary)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return kernel_floor_by_deployment(entry.expression, deployments, 1.0)  # against the kernels themselves
    except Exception:  # noqa: BLE001 - a view of an archive from elsewhere must not stop the command
        return None


def below_floor(ratios: FloorRatios) -> FloorRatios:
    """The deployments where the model is faster than its kernels, lowest ratio first."""
    return sorted(((d, r) for d, r in ratios if r is not None and r < 1), key=lambda dr: dr[1])


def floor_note(ratios: FloorRatios | None, entry_id: str) -> str | None:
    """One warning naming each deployment below its kernel floor (None where there is none)."""
    low = below_floor(ratios or [])
    if not low:
        return None
    where = ", ".join(f"{d.model.name} TP{d.tp} ({r:.2f}x)" for d, r in low)
    text = (
        f"warning: on {where}, {entry_id} prices some steps below the measured kernels they run, "
        f"so it cannot be right there (python -m evolve archive show {entry_id} lists every deployment)"
    )
    return textwrap.fill(text, 80)


FLOOR_TITLE = "Step time over the measured kernels it runs, lowest on the probes"
FLOOR_CAPTION = (
    "below 1: faster than its kernels, so wrong there; 1 or more is necessary, not sufficient."
    " -: no probe fits in memory, or no kernel tables; blank: the TP does not divide the heads"
)


def floor_rows(ratios: FloorRatios) -> list[list[str]]:
    """One row per catalog model: its name, then one cell per TP of ``CATALOG_TPS``."""
    from primitives.deployment import CATALOG_TPS

    by_model: dict[str, dict[int, str]] = {}
    for d, r in ratios:
        by_model.setdefault(d.model.name, {})[d.tp] = "-" if r is None else (f"{r:.2f} !" if r < 1 else f"{r:.2f}")
    return [[model, *(by_model[model].get(tp, "") for tp in CATALOG_TPS)] for model in sorted(by_model)]


def floor_table(ratios: FloorRatios):
    """``floor_rows`` as a rich table."""

    from evolve.report import titled_table
    from primitives.deployment import CATALOG_TPS

    table = titled_table(f"{FLOOR_TITLE} ({ratios[0][0].gpu.name})", FLOOR_CAPTION)
    table.add_column("model")
    for tp in CATALOG_TPS:
        table.add_column(f"TP{tp}", justify="right")
    for row in floor_rows(ratios):
        table.add_row(*row)
    return table


def print_floor_note(
    entry: ArchiveEntry,
    run_dir: Path | None,
    resolver: DeploymentResolver,
    primary: Deployment | None = None,
    primary_only: bool = False,
) -> None:
    """``floor_note`` for ``archive best`` and ``export-go`` (PRIMARY_ONLY: that deployment
    alone, the one ``export-go --out`` bakes in)."""
    note = floor_note(catalog_floor(entry, run_dir, resolver, primary, primary_only), entry.id)
    if note:
        print(note)


def print_run_floor_note(run_dir: Path) -> None:
    """``print_floor_note`` for the model a finished run recommends (the end of ``run``);
    nothing where the run left no front."""
    from archive.rundir import RunDir
    from archive.select import recommend
    from archive.store import ArchiveStore
    from primitives.deployment import DeploymentResolver

    try:
        with ArchiveStore(RunDir(run_dir).archive, create=False, read_only=True) as store:
            best = recommend(store.front())
    except Exception:  # noqa: BLE001 - interrupted before a front, or a damaged archive: said elsewhere
        return
    print_floor_note(best, Path(run_dir), DeploymentResolver())


__all__ = [
    "FLOOR_CAPTION",
    "FLOOR_TITLE",
    "FloorRatios",
    "below_floor",
    "catalog_floor",
    "floor_note",
    "floor_rows",
    "floor_table",
    "print_floor_note",
    "print_run_floor_note",
    "run_resolver",
]
