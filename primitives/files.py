"""Reading and writing files: one atomic writer and one reader of JSON/YAML mappings.

Every file the tool writes goes through :func:`atomic_write_bytes` (a temp file in the
same folder, fsync, rename), so a killed process never leaves a half-written file. Every
JSON or YAML input is read through :func:`read_mapping`, which turns any problem into a
one-line :class:`~primitives.errors.InputError`. Whether a folder can be written is found
by a real create (:func:`probe_create`, :func:`writable_dir`).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Hashable
from pathlib import Path

import yaml

from primitives.errors import InputError


def _new_file_mode(path: Path) -> int:
    """The mode PATH keeps if it exists, else what open() would give a new file (0666 less the umask)."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def regular_target(path: str | os.PathLike, option: str | None = None) -> Path:
    """PATH if a file may be written there: absent, or a regular file. A device, FIFO, socket,
    directory or symlink is refused (a rename would replace it with a file), in one line."""
    path = Path(path)
    try:
        mode = path.lstat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # a new file (a bad parent fails when written)
        return path
    except OSError as exc:
        raise InputError(path, option, f"cannot write ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        kind = next(
            (name for test, name in _NON_REGULAR if test(mode)),
            "not a regular file",
        )
        raise InputError(path, option, f"is {kind}; expected a regular file to write (or a new name)")
    return path


_NON_REGULAR = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


PROBE_PREFIX = ".probe."  # a write probe's name: PROBE_PREFIX + random + ".tmp" (a killed probe's leftover)


def probe_create(directory: str | os.PathLike) -> None:
    """Create and remove a file of a fresh name in DIRECTORY, or raise the OSError that stops it.

    A real create, because ``os.access`` says yes to root everywhere and a read-only mount is
    no permission bit; a fresh name (mkstemp), because a fixed one could be the user's file.
    """
    fd, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, suffix=".tmp", dir=directory)
    os.close(fd)
    os.unlink(probe)


def writable_dir(path, option: str):
    """Create ``path`` if needed and make sure we can write there; else one-line InputError."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(path, option, "exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(path, option, f"cannot create the directory ({exc.strerror or exc})") from None
    try:
        probe_create(path)
    except OSError as exc:
        raise InputError(path, option, f"cannot write there ({(exc.strerror or str(exc)).lower()})") from None
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write DATA to PATH atomically: temp file beside it, fsync, then rename over it.
    Only to a regular path (``regular_target``)."""
    path = regular_target(path)
    mode = _new_file_mode(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)  # mkstemp makes 0600; the file should look as a plain write would
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, payload, **dumps_kwargs) -> Path:
    return atomic_write_text(path, json.dumps(payload, **dumps_kwargs) + "\n")


def require_regular_input(path: Path) -> None:
    """An existing input must be a regular file: reading a FIFO or a device would block or never end."""
    if path.exists() and not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file (a device, FIFO or socket)"
        raise InputError(path, None, f"is {kind}; expected a file")


def read_text(path: str | os.PathLike) -> str:
    """The file's text; a missing, unreadable or empty file is a one-line InputError."""
    path = Path(path)
    require_regular_input(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(path, None, "file not found") from None
    except OSError as exc:
        raise InputError(path, None, f"cannot read file ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise InputError(path, None, f"not a text file (byte {exc.start} is not UTF-8)") from None
    if not text.strip():
        raise InputError(path, None, "the file is empty")
    return text


class _DuplicateKey(ValueError):
    pass


def _unique_pairs(pairs: list[tuple]) -> dict:
    """A mapping from (key, value) pairs; a key given twice is refused (JSON and YAML would
    silently keep the last one)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (a merged ``<<``
    key may still be overridden, as YAML allows)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            keys = [self.construct_object(k, deep=deep) for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]
            # an unhashable key (a list) is left to PyYAML, which refuses it as invalid YAML
            _unique_pairs([(k, None) for k in keys if isinstance(k, Hashable)])
        return super().construct_mapping(node, deep=deep)


def parse_mapping(text: str, path: str | os.PathLike, kind: str) -> dict:
    """TEXT parsed as JSON (``kind="json"``) or YAML; anything but a mapping, or a mapping
    that gives a key twice, is an InputError."""
    try:
        if kind == "json":
            data = json.loads(text, object_pairs_hook=_unique_pairs)
        else:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except json.JSONDecodeError as exc:
        raise InputError(path, None, f"not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except yaml.YAMLError as exc:
        raise InputError(path, None, f"not valid YAML ({str(exc).splitlines()[0]})") from None
    except _DuplicateKey as exc:
        raise InputError(path, str(exc.args[0]), "given twice; expected each key once") from None
    except RecursionError:
        raise InputError(path, None, "nested too deeply to read") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise InputError(path, None, f"not valid {kind.upper()} ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(data, dict):
        what = "a JSON object" if kind == "json" else "a mapping at the top level"
        raise InputError(path, None, f"expected {what}, got {type(data).__name__}")
    return data


def read_mapping(path: str | os.PathLike, kind: str | None = None) -> dict:
    """A JSON or YAML file (by KIND, else by suffix) that must hold a mapping."""
    path = Path(path)
    if kind is None:
        kind = "json" if path.suffix.lower() == ".json" else "yaml"
    return parse_mapping(read_text(path), path, kind)
