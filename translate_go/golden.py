"""Golden vectors: random batches, the Python reference step time, compact embedding.

The reference is the project's own Python path, not a re-implementation:
``primitives.compute.features_from_requests`` -> ``primitive_columns`` ->
``primitives.language.evaluate_expr``. The generated Go test must reproduce it.

A batch is an ``int64`` array of shape (n_requests, 4) whose columns are the BLIS
``Request`` fields in ``primitives.registry.REQUEST_FIELDS`` order: ProgressIndex,
NumNewTokens, len(InputTokens), len(OutputTokens).
"""

from __future__ import annotations

import math
import struct
from typing import Sequence

import numpy as np
import sympy as sp

from primitives.compute import features_from_requests, kernel_binding, primitive_columns
from primitives.data.experiments import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from primitives.deployment import Deployment
from primitives.language import evaluate_expr
from translate_go.codegen import expression_primitives, required_features

# the golden batches span the server limits of every experiment in the data
MAX_MODEL_LEN = DEFAULT_MAX_MODEL_LEN  # prompt + output KV limit
MAX_PREFILL_CHUNK = DEFAULT_MAX_NUM_BATCHED_TOKENS  # no prefill chunk is longer
MAX_BATCH = DEFAULT_MAX_NUM_SEQS  # requests per batch
INT64_MAX = 2**63 - 1


# --- the seeded batch generator (mirrored in Go: goldenBatch in step_time_test.go.tmpl)
# A counter-based SplitMix64: draw k of a seed is mix(seed + (k+1)*GAMMA). Integer-only,
# so Python (vectorised with numpy uint64) and Go produce the very same batches and the
# generated test embeds only the seed, the shape limits and per-batch checksums.
_GAMMA = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
HEADER_DRAWS = 3  # batch size, prefill-share mode, prefill share
DRAWS_PER_REQUEST = 4  # phase, input_len, progress/output_len, new_tokens


def draws_per_batch(max_batch: int = MAX_BATCH) -> int:
    return HEADER_DRAWS + DRAWS_PER_REQUEST * max_batch


def splitmix_draws(seed: int, start: int, count: int) -> np.ndarray:
    """Draws start .. start+count-1 of SEED (uint64)."""
    with np.errstate(over="ignore"):
        k = np.arange(start, start + count, dtype=np.uint64) + np.uint64(1)
        z = np.uint64(int(seed) & _MASK64) + k * np.uint64(_GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def random_batches(
    n_batches: int,
    seed: int = 0,
    max_batch: int = MAX_BATCH,
    max_model_len: int = MAX_MODEL_LEN,
    max_prefill_chunk: int = MAX_PREFILL_CHUNK,
) -> list[np.ndarray]:
    """N_BATCHES seeded batches of 1..MAX_BATCH requests, prefill and decode mixed.

    Each batch's prefill share (per mille) is 0, 1000 or uniform in 0..1000, so
    all-decode and all-prefill batches occur too. Prefill requests have progress <
    input_len and a chunk of at most MAX_PREFILL_CHUNK new tokens; decode requests have
    one new token and progress = input_len + output_len - 1. input_len is 1 ..
    MAX_MODEL_LEN-1 and KV (progress + new) never exceeds MAX_MODEL_LEN.
    """
    if max_batch < 1 or max_model_len < 2 or max_prefill_chunk < 1:
        raise ValueError("max_batch, max_prefill_chunk >= 1 and max_model_len >= 2 required")
    per_batch = draws_per_batch(max_batch)
    batches = []
    for b in range(int(n_batches)):
        z = splitmix_draws(seed, b * per_batch, per_batch)
        n = 1 + int(z[0] % np.uint64(max_batch))
        mode = int(z[1] % np.uint64(3))
        share = 0 if mode == 0 else 1000 if mode == 1 else int(z[2] % np.uint64(1001))
        r = z[HEADER_DRAWS : HEADER_DRAWS + DRAWS_PER_REQUEST * n].reshape(n, DRAWS_PER_REQUEST)
        prefill = (r[:, 0] % np.uint64(1000)).astype(np.int64) < share
        input_len = 1 + (r[:, 1] % np.uint64(max_model_len - 1)).astype(np.int64)
        u_input = input_len.astype(np.uint64)
        # prefill: progress in [0, input_len), new in [1, min(input_len - progress, chunk)]
        progress_p = (r[:, 2] % u_input).astype(np.int64)
        room = np.minimum(input_len - progress_p, max_prefill_chunk)
        new_p = 1 + (r[:, 3] % room.astype(np.uint64)).astype(np.int64)
        # decode: output_len in [1, max_model_len - input_len]
        out_d = 1 + (r[:, 2] % (np.uint64(max_model_len) - u_input)).astype(np.int64)
        progress = np.where(prefill, progress_p, input_len + out_d - 1)
        new_tokens = np.where(prefill, new_p, 1)
        output_len = np.where(prefill, 0, out_d)
        batches.append(np.stack([progress, new_tokens, input_len, output_len], axis=1).astype(np.int64))
    return batches


def batch_checksum(batch) -> int:
    """Sum of every field of every request (the Go test checks its regenerated batches)."""
    return int(np.asarray(batch, dtype=np.int64).sum())


def as_batch(batch) -> np.ndarray:
    """Validate one batch: non-negative integers, shape (n, 4)."""
    arr = np.asarray(batch, dtype=np.float64).reshape(-1, 4) if len(batch) else np.zeros((0, 4))
    if np.any(arr < 0) or np.any(arr != np.floor(arr)) or np.any(arr >= 2**31):
        raise ValueError("request fields must be non-negative integers below 2^31")
    return arr.astype(np.int64)


def python_step_time_us(expr: sp.Expr, deployment: Deployment, batches: Sequence) -> np.ndarray:
    """The step time (µs, unrounded) Python computes for each batch."""
    batches = [as_batch(b) for b in batches]
    n = len(batches)
    prims = expression_primitives(expr)
    sizes = np.array([len(b) for b in batches], dtype=np.int64)
    rows = np.concatenate(batches) if n and sizes.sum() else np.zeros((0, 4), dtype=np.int64)
    step_index = np.repeat(np.arange(n), sizes)
    feats = features_from_requests(
        step_index, rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], n, names=required_features(prims)
    )
    cols = (
        primitive_columns(feats, dict(deployment.constants), prims, kernel_binding(prims, [deployment]))
        if prims
        else {}
    )
    # Constant-only primitives come back with one row; give every column n rows.
    cols = {k: np.broadcast_to(np.asarray(v, dtype=np.float64), (n,)).copy() for k, v in cols.items()}
    return evaluate_expr(sp.sympify(expr), cols, n)


def _round_at_least(us: float, floor: int) -> int:
    """Go's roundAtLeast: math.Round (half away from zero), at least ``floor``; NaN gives
    ``floor`` and values beyond int64 saturate."""
    us = float(us)
    if not us >= floor:
        return floor
    if us >= 2.0**63:
        return INT64_MAX
    whole = math.floor(us)
    return int(whole + 1 if us - whole >= 0.5 else whole)


def round_step_us(us: float) -> int:
    """What the Go StepTime returns for ``us``: at least 1."""
    return _round_at_least(us, 1)


def round_overhead_us(us: float) -> int:
    """What the Go non-step methods return: at least 0."""
    return _round_at_least(us, 0)


def encode_batches(batches: Sequence) -> bytes:
    """uint32 little-endian stream: n_batches, then per batch n and n*4 fields row-major."""
    parts = [struct.pack("<I", len(batches))]
    for b in batches:
        arr = as_batch(b)
        parts.append(struct.pack("<I", len(arr)))
        parts.append(arr.astype("<u4").tobytes())
    return b"".join(parts)


def decode_batches(data: bytes) -> list[np.ndarray]:
    """Inverse of ``encode_batches`` (for tests)."""
    words = np.frombuffer(data, dtype="<u4").astype(np.int64)
    n, i, out = int(words[0]), 1, []
    for _ in range(n):
        m = int(words[i])
        out.append(words[i + 1 : i + 1 + 4 * m].reshape(m, 4))
        i += 1 + 4 * m
    return out


__all__ = [
    "as_batch",
    "batch_checksum",
    "draws_per_batch",
    "splitmix_draws",
    "decode_batches",
    "encode_batches",
    "python_step_time_us",
    "random_batches",
    "round_overhead_us",
    "round_step_us",
]
