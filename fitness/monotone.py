"""Monotone in work: probe steps on which a fitted step time must never get faster with more work.

For every deployment of the data, synthetic batches span the regimes a server meets
(empty to 128 decoding requests, contexts from 64 to 16k tokens, no prefill to a full
2,048-token chunk). Each has three heavier twins: 256 more prefill tokens, one more
decoding request, and 64 more tokens of KV per request. A candidate whose fitted step
time is lower on a twin than on its batch is not physics (it would make a server faster
under more load) and scores worst. The probes are built from per-request rows with the
same reductions as every other row (``primitives.compute``), so every primitive has a
value on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from primitives.compute import constant_columns, features_from_requests, kernel_binding, primitive_columns
from primitives.deployment import Deployment

DECODE_REQUESTS = (0, 1, 8, 32, 128)
CONTEXTS = (64, 512, 2048, 16384)
PREFILL_CHUNKS = (0, 16, 512, 2048)
MORE_PREFILL_TOKENS, MORE_KV_TOKENS = 256, 64
TOLERANCE = 1e-9  # relative: round-off of equal predictions is not a violation


def _batch(decodes: int, context: int, chunk: int, extra_kv: int = 0) -> np.ndarray:
    """Rows (progress, new_tokens, input_len, output_len) of one batch."""
    rows = [(context + extra_kv, 1, context // 2, context - context // 2)] * decodes
    if chunk:
        prefix = context // 4 + extra_kv  # a cached prefix the chunk attends to
        rows.append((prefix, chunk, prefix + chunk + 1, 0))
    return np.array(rows, dtype=np.float64).reshape(-1, 4)


def probe_batches() -> list[tuple[np.ndarray, list[np.ndarray]]]:
    """(batch, its heavier twins) for every probe; batches with no work are skipped."""
    out = []
    for d in DECODE_REQUESTS:
        for c in CONTEXTS:
            for p in PREFILL_CHUNKS:
                if d == 0 and p == 0:
                    continue
                twins = [
                    _batch(d, c, p + MORE_PREFILL_TOKENS),
                    _batch(d + 1, c, p),
                    _batch(d, c, p, MORE_KV_TOKENS),
                ]
                out.append((_batch(d, c, p), twins))
    return out


@dataclass
class MonotoneProbes:
    """Primitive columns of the probe batches (``base``) and of their heavier twins (``heavier``)."""

    base: dict[str, np.ndarray]
    heavier: dict[str, np.ndarray]  # row i*3 + t is twin t of base row i
    n: int

    @classmethod
    def build(cls, deployments: list[Deployment], names: list[str]) -> "MonotoneProbes":
        probes = probe_batches()
        batches = [b for b, _ in probes]
        twins = [t for _, ts in probes for t in ts]
        return cls(_columns(batches, deployments, names), _columns(twins, deployments, names), len(batches))

    def holds(self, predict: Callable[[dict, int], np.ndarray]) -> bool:
        """Whether ``predict(columns, n)`` never decreases from a batch to a heavier twin."""
        n_dep = len(next(iter(self.base.values()))) // self.n if self.base else 0
        if not n_dep:
            return True
        base = predict(self.base, self.n * n_dep)
        heavy = predict(self.heavier, 3 * self.n * n_dep)
        base3 = np.repeat(base, 3)
        return bool(np.all(heavy >= base3 - TOLERANCE * np.abs(base3)))


def _columns(batches: list[np.ndarray], deployments: list[Deployment], names: list[str]) -> dict[str, np.ndarray]:
    """Primitive columns of every batch under every deployment (deployment-major)."""
    sizes = np.array([len(b) for b in batches])
    rows = np.concatenate(batches)
    step = np.repeat(np.arange(len(batches)), sizes)
    feats = features_from_requests(step, rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], len(batches))
    n_dep = len(deployments)
    row_dep = np.repeat(np.arange(n_dep), len(batches))
    tiled = {k: np.tile(v, n_dep) for k, v in feats.items()}
    consts = constant_columns(deployments, row_dep)
    return primitive_columns(tiled, consts, names, kernel_binding(names, deployments, row_dep))


__all__ = ["MonotoneProbes", "probe_batches"]
