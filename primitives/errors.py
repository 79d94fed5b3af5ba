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
