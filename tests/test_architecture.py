"""The architecture contract: imports flow one way, no package cycles, ruff-clean, small files.

Layers (pyproject.toml, ``[tool.importlinter]``): primitives at the bottom; fitness, seeds
and archive above it and independent of each other; evolve and translate_go on top. These
tests run the real tools on the checkout, so a wrong import fails CI, not a review.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("primitives", "fitness", "seeds", "archive", "evolve", "translate_go")
MAX_SOURCE_LINES = 500


def _tool(name: str) -> list[str]:
    exe = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(exe).exists():
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]'")
    return [exe]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept():
    out = _run(_tool("lint-imports") + ["--no-cache"])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_lint_is_clean():
    out = _run(_tool("ruff") + ["check", "--no-cache", "."])
    assert out.returncode == 0, out.stdout[-4000:]


def test_ruff_format_is_clean():
    out = _run(_tool("ruff") + ["format", "--check", "--no-cache", "."])
    assert out.returncode == 0, out.stdout[-4000:]


def test_no_source_file_over_the_limit():
    big = {
        str(p.relative_to(ROOT)): n
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_SOURCE_LINES
    }
    assert not big, f"source files over {MAX_SOURCE_LINES} lines: {big}"


def test_primitives_import_nothing_else_of_the_project():
    """The layers contract says so too; this names the offending line when it breaks."""
    offenders = []
    for p in (ROOT / "primitives").rglob("*.py"):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            words = line.strip().split()
            if len(words) > 1 and words[0] in ("from", "import"):
                top = words[1].split(".")[0]
                if top in PACKAGES and top != "primitives":
                    offenders.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
