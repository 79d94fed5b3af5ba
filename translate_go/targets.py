"""Where export-go may write, and for which deployment: the checks shared by the
stand-alone package export and the BLIS backend export (one-line errors, exit 2)."""

from __future__ import annotations

import re
from pathlib import Path

from archive.entry import ArchiveEntry
from primitives.deployment import Deployment, DeploymentResolver
from primitives.errors import InputError
from translate_go.model_file import GENERATED_MARK
from translate_go.printer import GO_KEYWORDS

_GO_IDENT = re.compile(r"^[a-z][a-z0-9_]*$")
_PACKAGE_CLAUSE = re.compile(r"^package\s+(\w+)", re.M)


def check_package_name(package: str) -> str:
    """A lower-case Go identifier that is neither a keyword nor ``main`` (a command, not a library)."""
    if not _GO_IDENT.match(package or "") or package in GO_KEYWORDS or package == "main":
        raise InputError(
            "--package",
            None,
            f"expected a lower-case Go identifier, not a keyword, such as 'steptime'; got {package!r}",
        )
    return package


def check_own_files(paths: list[Path]) -> None:
    """Refuse to overwrite a file export-go did not write (it knows its own first line)."""
    for path in paths:
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise InputError(path, None, "expected a regular file to write; refusing to replace this")
        if path.is_file():
            try:
                first = path.read_text(encoding="utf-8", errors="replace").split("\n", 1)[0]
            except OSError as exc:
                raise InputError(path, None, f"cannot read it ({exc.strerror})") from None
            if GENERATED_MARK not in first:
                raise InputError(
                    path, None, f"not written by export-go (no '// {GENERATED_MARK}' line); not overwritten"
                )


def check_package_dir(out: Path, package: str, ours: list[Path]) -> None:
    """Refuse a folder whose other Go files belong to another package."""
    if not out.is_dir():
        return
    for go_file in sorted(out.glob("*.go")):
        if go_file in ours:
            continue
        try:
            m = _PACKAGE_CLAUSE.search(go_file.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
        if m and m.group(1).removesuffix("_test") != package:
            raise InputError(
                out, "--package", f"the folder holds Go package {m.group(1)!r} ({go_file.name}), not {package!r}"
            )


def choose_deployment(
    entry: ArchiveEntry,
    run_dir: str | Path | None,
    resolver: DeploymentResolver,
    model: str | None = None,
    tp: int | None = None,
    gpu: str | None = None,
) -> tuple[Deployment, str]:
    """The deployment MODEL/TP names, else the first one the entry's run trained on; and
    how it was chosen (for the user)."""
    if model:
        return resolver.resolve(model, tp, gpu), "--model/--tp"
    from archive import rundir  # looked up at call time (tests replace it)

    known = rundir.run_deployments(entry, run_dir)
    first = known[0]
    others = sorted({f"{d.model} --tp {d.tp}" for d in known} - {f"{first.model} --tp {first.tp}"})
    how = f"the run's first deployment, experiment {first.experiment}; " + (
        f"others: --model {', --model '.join(others)}" if others else "the run's only one"
    )
    return resolver.resolve(first.model, first.tp, gpu or first.gpu), how


__all__ = ["check_own_files", "check_package_dir", "check_package_name", "choose_deployment"]
