"""go.mod: the module file of an exported package, and finding an enclosing one."""

from __future__ import annotations

from pathlib import Path

from translate_go.gosource import render_template

GO_VERSION = "1.21"


def gomod_source(module: str) -> str:
    """The text of a go.mod declaring MODULE (standard library only, no requirements)."""
    return render_template("go.mod.tmpl", module=module, go_version=GO_VERSION)


def enclosing_go_mod(directory: Path) -> Path | None:
    """The go.mod of DIRECTORY or of the nearest parent that has one."""
    for d in [Path(directory).resolve(), *Path(directory).resolve().parents]:
        if (d / "go.mod").is_file():
            return d / "go.mod"
    return None


__all__ = ["GO_VERSION", "enclosing_go_mod", "gomod_source"]
