"""How the archive stores JSON: plain values for numpy scalars and paths, and stored text read
back as what it must be, or a damaged-archive error naming where."""

from __future__ import annotations

import json
from pathlib import Path


def json_default(obj: object) -> object:
    # numpy scalars/arrays and Paths show up in stats and configs; store them as plain JSON.
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return obj.item()
        except (ValueError, TypeError):
            pass
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (Path, set, frozenset, tuple)):
        return str(obj) if isinstance(obj, Path) else list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def dumps(obj: object) -> str:
    return json.dumps(obj, default=json_default)


def json_or_damage(text: object, damaged):
    try:
        return json.loads(text)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise damaged(exc) from None


def id_list(text: object, damaged) -> list[str]:
    """A generation's stored list of entry ids (``damaged(exc)``: the error where it is not one)."""
    ids = json_or_damage(text, damaged)
    if not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
        raise damaged(ValueError(f"expected a list of entry ids, got {ids!r:.60}"))
    return ids
