"""``export_go``: an archived step-time expression -> a Go package for BLIS.

Writes ``step_time.go`` (the model, ``translate_go.model_file``), ``step_time_test.go``
(golden vectors computed by Python, a rounding/overhead test, ``BenchmarkStepTime`` on a
128-request batch; ``translate_go.golden_test_file``) and a ``go.mod`` when the directory
has none (``translate_go.gomod``). The output is gofmt-clean by construction
(``translate_go.goformat``, ``translate_go.gosource``) and needs nothing beyond the Go
standard library. This module resolves the entry and the deployment and writes the files.
"""

from __future__ import annotations

from pathlib import Path

import sympy as sp

from archive.entry import ArchiveEntry
from archive.rundir import run_deployments
from primitives.deployment import Deployment, DeploymentResolver
from primitives.errors import InputError
from primitives.files import atomic_write_text
from primitives.language import parse_infix
from translate_go.golden_test_file import golden_test_source
from translate_go.gomod import enclosing_go_mod, gomod_source
from translate_go.model_file import INTERFACES, model_file_source
from translate_go.non_step import resolve_overheads
from translate_go.printer import GoPrintError
from translate_go.targets import check_own_files, check_package_dir, check_package_name


def parse_entry_expression(entry: ArchiveEntry) -> sp.Expr:
    """The entry's expression as sympy (primitives.language.parse_infix)."""
    try:
        return parse_infix(entry.expression)
    except Exception as exc:  # sympy raises many kinds; report one line
        raise InputError(
            f"archive entry {entry.id}", "expression", f"cannot parse {entry.expression!r} ({exc})"
        ) from None


def default_deployment(
    entry: ArchiveEntry,
    resolver: DeploymentResolver,
    *,
    gpu: str | None = None,
    run_dir: str | Path | None = None,
) -> Deployment:
    """The deployment to bake in when none is named: the first of ``archive.rundir.run_deployments``.

    GPU overrides the trace's gpu column (default: the resolver's default GPU).
    """
    first = run_deployments(entry, run_dir)[0]
    return resolver.resolve(first.model, first.tp, gpu or first.gpu)


def export_go(
    entry: ArchiveEntry,
    deployment: Deployment | None,
    out_dir: str | Path,
    package: str = "steptime",
    interface: str = "blis",
    n_golden: int = 1000,
    seed: int = 0,
    expr: sp.Expr | None = None,
) -> list[Path]:
    """Write step_time.go, step_time_test.go (and go.mod unless OUT_DIR is already inside a
    Go module); return the paths written.

    EXPR overrides the parsed ``entry.expression`` (the same expression as sympy).
    DEPLOYMENT None means the run's first deployment (``default_deployment``, built-in
    model configs and GPU).
    """
    check_package_name(package)
    if interface not in INTERFACES:
        raise InputError("interface", None, f"expected one of {list(INTERFACES)}, got {interface!r}")
    if int(n_golden) < 1:
        raise InputError("n_golden", None, f"expected at least 1 golden batch, got {n_golden!r}")
    expr = parse_entry_expression(entry) if expr is None else sp.sympify(expr)
    if deployment is None:  # the constants must come from somewhere: the run's first deployment
        deployment = default_deployment(entry, DeploymentResolver())
    overheads, defaulted = resolve_overheads(entry)
    try:
        model_src = model_file_source(expr, deployment, entry, package, interface, overheads, defaulted)
    except GoPrintError as exc:
        raise InputError(f"archive entry {entry.id}", "expression", str(exc)) from None
    test_src = golden_test_source(expr, deployment, package, interface, overheads, int(n_golden), int(seed))
    out = Path(out_dir)
    targets = [out / "step_time.go", out / "step_time_test.go"]
    check_own_files(targets)
    check_package_dir(out, package, targets)
    out.mkdir(parents=True, exist_ok=True)
    written = [
        atomic_write_text(out / "step_time.go", model_src),
        atomic_write_text(out / "step_time_test.go", test_src),
    ]
    if enclosing_go_mod(out) is None:  # inside a module (e.g. BLIS's tree) the package joins it
        written.append(atomic_write_text(out / "go.mod", gomod_source(package)))
    return written


__all__ = [
    "INTERFACES",
    "check_own_files",
    "check_package_dir",
    "check_package_name",
    "default_deployment",
    "export_go",
    "parse_entry_expression",
]
