"""``export_blis``: an archived step-time expression -> a backend inside a BLIS checkout.

Writes ``sim/latency/<name>_latency.go`` and its test (``translate_go.blis_model``)
and registers the backend (``translate_go.blis_checkout``); nothing is left for the
user to edit. The golden tests run inside BLIS's own ``go test ./sim/latency/``.
"""

from __future__ import annotations

from pathlib import Path

import sympy as sp

from archive.entry import ArchiveEntry
from primitives.deployment import Deployment, DeploymentResolver
from primitives.errors import InputError
from primitives.files import atomic_write_text
from primitives.registry import PRIMITIVE_BY_NAME
from translate_go.blis_checkout import (
    check_backend_name,
    check_checkout,
    check_writable,
    file_stem,
    plan_registration,
    register_backend,
)
from translate_go.blis_model import BLIS_PACKAGE, blis_model_source, blis_test_source, prefix_identifiers
from translate_go.codegen import expression_primitives
from translate_go.export import default_deployment, parse_entry_expression
from translate_go.non_step import resolve_overheads
from translate_go.printer import GoPrintError
from translate_go.targets import check_own_files, check_package_dir


def export_blis(
    entry: ArchiveEntry,
    deployment: Deployment | None,
    checkout: str | Path,
    name: str = "stepsynth",
    *,
    resolver: DeploymentResolver | None = None,
    n_golden: int = 1000,
    seed: int = 0,
    expr: sp.Expr | None = None,
) -> tuple[list[Path], list[str]]:
    """Write the backend into the checkout and register it; return (files written, changes made).

    DEPLOYMENT is the golden tests' main deployment (None: the run's first); the
    resolver's other catalog models at TP 1, 2, 4, 8 are checked too and, when the
    expression uses measured kernels, their tables embedded.
    """
    check_backend_name(name)
    root = Path(checkout)
    check_checkout(root)
    if int(n_golden) < 1:
        raise InputError("n_golden", None, f"expected at least 1 golden batch, got {n_golden!r}")
    resolver = resolver or DeploymentResolver()
    expr = parse_entry_expression(entry) if expr is None else sp.sympify(expr)
    if deployment is None:
        deployment = default_deployment(entry, resolver)
    overheads, defaulted = resolve_overheads(entry)
    deployments = resolver.catalog_deployments(deployment)
    try:
        uses_kernels = any(PRIMITIVE_BY_NAME[p].kernels for p in expression_primitives(expr))
        kernel_deployments = [d for d in deployments if d.gpu.kernel_dir] if uses_kernels else []
        model_src = blis_model_source(expr, deployment, kernel_deployments, entry, name, overheads, defaulted)
    except GoPrintError as exc:
        raise InputError(f"archive entry {entry.id}", "expression", str(exc)) from None
    test_src = blis_test_source(expr, deployment, deployments[1:], name, overheads, int(n_golden), int(seed))
    model_src, test_src = prefix_identifiers([model_src, test_src], name)
    folder = root / "sim" / "latency"
    targets = [folder / f"{file_stem(name)}.go", folder / f"{file_stem(name)}_test.go"]
    check_own_files(targets)
    check_package_dir(folder, BLIS_PACKAGE, targets)
    plan = plan_registration(root, name)  # refuses before anything is written
    check_writable(targets + [path for path, text, _ in plan if text is not None])
    written = [atomic_write_text(targets[0], model_src), atomic_write_text(targets[1], test_src)]
    return written, register_backend(root, name, plan)


__all__ = ["export_blis"]
