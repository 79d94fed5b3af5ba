"""The schema layer: one set of field checks for every input (configs, datasheets, experiments, traces).

Each check takes the raw value, the file and the (dotted) field it came from, and either
returns the value in its proper type or raises a one-line
:class:`~primitives.errors.InputError` saying what was expected. Plain functions rather
than pydantic: the inputs are a handful of small mappings and a few numeric columns, and
this keeps the start-up of the default run free of a schema library.

The bounds are physical sanity limits, far beyond any real deployment, chosen so that
whatever passes fits in memory and in a float64 (token counts below 2**31, a few
million simulated requests).
"""

from __future__ import annotations

import math
from typing import Any

from primitives.errors import InputError

MAX_TOKENS = 10_000_000  # one prompt, one output or a model's context
MAX_STEP_TOKENS = 100_000_000  # tokens of one step (a batch of contexts)
MAX_TP = 1024
MAX_RATE_PER_S = 100_000.0
MAX_DURATION_S = 7 * 24 * 3600.0  # a week of load
MAX_REQUESTS = 1_000_000  # simulated requests of one experiment (rate x duration, summed); real: <= 16,800
# tokens one simulation streams (requests x output_len): its per-token log must fit in memory; real: <= 7e6
MAX_SIMULATED_TOKENS = 100_000_000
MAX_MODEL_DIM = 10_000_000  # hidden sizes, layer and head counts, vocabularies
MAX_INTEGER = 2**1000  # about 1e301: no real quantity; a larger integer is refused before a float conversion overflows


def number(
    value: Any,
    path: object,
    field: str,
    *,
    integer: bool = False,
    positive: bool = True,
    allow_zero: bool = False,
    upper: float | None = None,
    text_ok: bool = False,
) -> float | int:
    """VALUE as a finite number (an int if INTEGER), within the bounds; booleans are not numbers.

    ``text_ok``: numeric strings are accepted (YAML files sometimes quote numbers); JSON
    configs and datasheets do not get that leniency.
    """
    if value is None:
        raise InputError(path, field, "a required field is missing (expected a number)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if not text_ok or isinstance(value, bool):
            raise InputError(path, field, f"expected a number, got {value!r}")
        try:
            value = float(str(value).strip())
        except ValueError:
            raise InputError(path, field, f"expected a number, got {value!r}") from None
    if isinstance(value, int) and abs(value) > MAX_INTEGER:  # a float cannot hold it
        raise InputError(path, field, f"expected a number of sensible size, got one of {len(str(abs(value)))} digits")
    if not math.isfinite(value):
        raise InputError(path, field, f"expected a finite number, got {value!r}")
    if integer:
        if float(value) != int(value):
            raise InputError(path, field, f"expected an integer, got {value!r}")
        value = int(value)
    if positive and (value < 0 or (value == 0 and not allow_zero)):
        raise InputError(
            path, field, f"expected a {'non-negative' if allow_zero else 'positive'} number, got {value!r}"
        )
    if upper is not None and value > upper:
        raise InputError(path, field, f"expected at most {upper:g}, got {value!r}")
    return value


def boolean(value: Any, path: object, field: str) -> bool:
    """VALUE as a boolean: JSON/YAML true or false only (the string "false" is not false)."""
    if not isinstance(value, bool):
        raise InputError(path, field, f"expected true or false, got {value!r}")
    return value


def text(value: Any, path: object, field: str, expected: str) -> str:
    """VALUE as a non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise InputError(path, field, f"expected {expected}, got {value!r}")
    return value.strip()


def fraction(value: Any, path: object, field: str) -> float:
    """VALUE as a fraction in (0, 1]."""
    f = float(number(value, path, field, positive=False, text_ok=True))
    if not 0.0 < f <= 1.0:
        raise InputError(path, field, f"expected a fraction in (0, 1], got {value!r}")
    return f


def tp_fits_heads(model: str, n_heads: int, n_kv_heads: int, tp: int) -> None:
    """vLLM's rule: the attention heads split evenly over the GPUs, and the KV heads split
    evenly or are replicated evenly (TP a multiple of them). Field ``tp``: the caller names
    the file the TP came from."""
    if not 1 <= tp <= MAX_TP:
        raise InputError(model, "tp", f"expected a tensor-parallel degree in 1..{MAX_TP}, got {tp}")
    if n_heads % tp:
        raise InputError(model, "tp", f"TP {tp} does not divide the {n_heads} attention heads of {model}")
    if n_kv_heads % tp and tp % n_kv_heads:
        raise InputError(
            model, "tp", f"TP {tp} neither divides nor is a multiple of the {n_kv_heads} KV heads of {model}"
        )
