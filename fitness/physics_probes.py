"""Physics probes: steps on which a fitted step time must be monotone in work and no faster than its kernels.

For every deployment the export ships (``DeploymentResolver.with_catalog``), synthetic
batches span the regimes a server meets (empty to 128 decoding requests, contexts from 64
to 16k tokens, no prefill to a full 2,048-token chunk). Each has three heavier twins: 256
more prefill tokens, one more decoding request (at the batch's mean decode context), and
64 more tokens of KV per request. A candidate whose fitted step time is lower on a twin
than on its batch is not physics (it would make a server faster under more load) and
scores worst. The probes are built from per-request rows with the same reductions as
every other row (``primitives.compute``), so every primitive has a value on them.

The kernel floor: on every probe, the step can not run faster than ``floor_fraction``
(the lower efficiency bound, 1 by default) times the sum of the measured kernels it
must execute: its matmuls, decode attention and prefill attention
(``gemm_time_us + decode_attention_time_us + prefill_attention_time_us``, from the GPU's
measured kernel tables). The visible experiments hardly exercise heavy prefill (prefix
caching makes most of it free), so without this floor a search can fit them with a model
that prices a 2,048-token prefill chunk at a third of what its matmuls alone take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from primitives.compute import constant_columns, features_from_requests, kernel_binding, primitive_columns
from primitives.deployment import Deployment
from primitives.errors import InputError

KERNEL_TERMS = ("gemm_time_us", "decode_attention_time_us", "prefill_attention_time_us")

DECODE_REQUESTS = (0, 1, 8, 32, 128)
CONTEXTS = (64, 512, 2048, 16384)
PREFILL_CHUNKS = (0, 16, 512, 2048)
MORE_PREFILL_TOKENS, MORE_KV_TOKENS = 256, 64
TOLERANCE = 1e-9  # relative: round-off of equal predictions is not a violation


def _batch(decodes: int, context: int, chunk: int, extra_kv: int = 0, one_more: bool = False) -> np.ndarray:
    """Rows (progress, new_tokens, input_len, output_len) of one batch; ONE_MORE adds a decoding
    request at the batch's mean decode context as the aggregate primitives see it (the chunk's
    cached prefix is read with the decodes': ``decode_attention_time_us``). One more request
    like the others is more work; one shorter than the mean would lower the mean context the
    decode-attention lookup prices, which at a small, launch-bound batch can cost 0.2% less."""
    rows = [(context + extra_kv, 1, context // 2, context - context // 2)] * decodes
    prefix = context // 4 + extra_kv  # a cached prefix the chunk attends to
    if one_more:
        mean = context + extra_kv + (prefix / decodes if chunk and decodes else 0.0)
        rows = rows + [(mean, 1, context // 2, context - context // 2)]
    if chunk:
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
                    _batch(d, c, p, one_more=True),
                    _batch(d, c, p, MORE_KV_TOKENS),
                ]
                out.append((_batch(d, c, p), twins))
    return out


@dataclass
class PhysicsProbes:
    """Primitive columns of the probe batches (``base``) and of their heavier twins (``heavier``),
    the kernel floor of each base batch (µs; zeros where the GPU has no kernel tables), and
    which probes can exist at all (their KV fits in the deployment's cache)."""

    base: dict[str, np.ndarray]
    heavier: dict[str, np.ndarray]  # row i*3 + t is twin t of base row i
    floor_us: np.ndarray
    base_fits: np.ndarray
    heavier_fits: np.ndarray

    @classmethod
    def build(cls, deployments: list[Deployment], names: list[str], floor_fraction: float = 0.5) -> "PhysicsProbes":
        probes = probe_batches()
        batches = [b for b, _ in probes]
        twins = [t for _, ts in probes for t in ts]
        base = _columns(batches, deployments, names)
        try:
            kernels = _columns(batches, deployments, list(KERNEL_TERMS))
            floor = floor_fraction * sum(kernels[k] for k in KERNEL_TERMS)
        except InputError:  # a GPU without measured kernels: no floor
            floor = np.zeros(len(batches) * len(deployments))
        return cls(
            base,
            _columns(twins, deployments, names),
            floor,
            _fits(batches, deployments),
            _fits(twins, deployments),
        )

    def predictions(self, predict: Callable[[dict, int], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """``predict(columns, n)`` on the base batches and on their heavier twins."""
        return predict(self.base, len(self.floor_us)), predict(self.heavier, len(self.heavier_fits))

    def holds(self, predict: Callable[[dict, int], np.ndarray]) -> bool:
        """Monotone in work and never below the kernel floor (see the module doc)."""
        if not len(self.floor_us):
            return True
        base = predict(self.base, len(self.floor_us))
        if not np.all((base >= self.floor_us) | ~self.base_fits):
            return False
        heavy = predict(self.heavier, len(self.heavier_fits))
        return monotone(base, heavy, self.base_fits, self.heavier_fits)


def monotone(base: np.ndarray, heavy: np.ndarray, base_fits: np.ndarray, heavy_fits: np.ndarray) -> bool:
    """Whether every heavier twin (rows i*3 .. i*3+2 of HEAVY) takes at least as long as BASE[i],
    over the pairs that both fit in the KV cache."""
    base3 = np.repeat(base, 3)
    pairs = np.repeat(base_fits, 3) & heavy_fits
    return bool(np.all((heavy >= base3 - TOLERANCE * np.abs(base3)) | ~pairs))


def _fits(batches: list[np.ndarray], deployments: list[Deployment]) -> np.ndarray:
    """Deployment-major: whether each batch's KV fits in the deployment's cache (at vLLM's default memory share)."""
    kv = np.array([float((b[:, 0] + b[:, 1]).sum()) for b in batches])
    return np.concatenate([kv <= d.kv_capacity_tokens() for d in deployments])


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


__all__ = ["KERNEL_TERMS", "PhysicsProbes", "monotone", "probe_batches"]
