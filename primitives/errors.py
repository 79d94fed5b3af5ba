"""One kind of user-facing error for every loader and command.

A bad input is reported as a single line naming the file, the field and what was
expected; the CLI turns an ``InputError`` into that line and exit status 2.
"""

from __future__ import annotations


class InputError(Exception):
    """Malformed user input: which file, which field, what was expected."""

    def __init__(self, path: object, field: str | None, expected: str):
        self.path = str(path)
        self.field = field
        self.expected = expected
        where = self.path if field is None else f"{self.path}: {field}"
        super().__init__(f"{where}: {expected}")


def writable_dir(path, option: str):
    """Create ``path`` if needed and make sure we can write there; else one-line InputError."""
    import os
    import tempfile
    from pathlib import Path

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(path, option, "exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(path, option, f"cannot create the directory ({exc.strerror or exc})") from None
    try:  # a real create: os.access says yes to root everywhere, and a read-only mount is not a permission
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(path, option, f"cannot write there ({(exc.strerror or str(exc)).lower()})") from None
    return path
