"""numba's on-disk cache, kept in step with every file a compiled function is built from.

numba keys a cached function by its own source file only (its modification time and
size). The simulator core inlines functions of other files (the KV pool, the step-program
interpreter, the kernel lookups), so after an edit to one of those, a process would load
the old core from the cache and silently run stale code. Each module with such a function
calls :func:`flush_when_changed` at import: when the hash of the files it is built from
differs from the one recorded beside its cache, its cache index is emptied (numba then
compiles afresh, once) and the new hash recorded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def sources_digest(modules) -> str:
    h = hashlib.sha256()
    for m in modules:
        h.update(Path(m.__file__).read_bytes())
    return h.hexdigest()


def flush_when_changed(dispatchers, modules, tag: str) -> bool:
    """Empty the caches of DISPATCHERS if the sources of MODULES changed since they were cached.

    Returns whether it flushed. A cache that cannot be read or written (a read-only install,
    numba's cache off) is left to numba.
    """
    digest = sources_digest(modules)
    caches = [getattr(d, "_cache", None) for d in dispatchers]
    paths = {getattr(c, "_cache_path", None) for c in caches} - {None}
    if not paths:
        return False
    stamps = [Path(p) / f"{tag}.sources-sha256" for p in sorted(paths)]
    try:
        if all(s.is_file() and s.read_text() == digest for s in stamps):
            return False
        for c in caches:
            if c is not None and hasattr(c, "flush"):
                c.flush()
        for s in stamps:
            s.parent.mkdir(parents=True, exist_ok=True)
            s.write_text(digest)
    except OSError:
        return False
    return True
