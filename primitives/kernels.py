"""Measured GPU kernel timings, turned into per-deployment step-cost tables.

The measured tables (``data/kernels/<gpu>/``: bf16 matmuls by m x k x n, decode
attention by batch x context per head configuration and TP, prefill attention by
sequence length; see that folder's README) are single-kernel facts about the GPU.
For one deployment they become three small lookup tables, each already summed over
every layer and priced per GPU:

* ``kernel_gemm_us(tokens)``: every projection matmul of every layer at m = tokens
  (QKV, output, gated MLP; for MoE the expected experts a batch touches under top-k
  routing, each at the tokens it receives, plus the router).
* ``kernel_decode_attention_us(requests, context)``: decode attention of that many
  requests, each with ``context`` cached tokens.
* ``kernel_prefill_attention_us(chunk)``: causal prefill attention of one chunk.

How the measurements are stretched (documented here once, printed in RESULTS):

* matmul: a shape off the measured (k, n) grid uses the nearest grid shape's
  latency curve (in log k, log n) scaled by k*n/(k_grid*n_grid), so it keeps the
  measured efficiency at each m. Interpolation is linear in log m / log latency;
  below the smallest m the latency stays at its weight-bound floor, above the
  largest it grows in proportion to m (compute bound).
* decode attention: linear in log batch / log context / log latency between
  measured points; below the smallest context, a straight line through the two
  shortest contexts, never below the table's fastest call (the launch floor);
  above the longest context or largest batch, proportional (memory bound). A head
  configuration without a table uses the one with the nearest per-GPU heads,
  scaled by the ratio of per-GPU KV heads.
* prefill attention: the table has no TP degree; the heads split across GPUs, so
  the per-GPU time is the table's over TP. No launch floor: vLLM runs one attention
  kernel per layer for the whole mixed batch, whose launch the decode lookup prices.
  Below the shortest sequence the first segment's log-log slope continues; above
  the longest, the time grows with the square of the length.

The three lookups are then sampled on uniform log2 grids, so that evaluating them
(numpy here, Go in ``translate_go``) is the same arithmetic: linear interpolation of
log2(latency) in log2(x), clamped at the grid's ends, and 0 for no work. Every
table is made monotone (more work never takes less time): a point is lowered to the
fastest time measured for more work, which drops warm-up outliers (a 38 µs decode call
at batch 1 that takes 23 µs with four times the context).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from importlib import resources
from itertools import pairwise
from pathlib import Path

import numpy as np

from . import checks
from .errors import InputError
from .files import read_text
from .lookup import lookup1, lookup1_array, lookup2, lookup2_array

BUILTIN_KERNEL_GPUS = {"h100sxm": "h100", "h100": "h100"}


def builtin_kernel_dir(gpu_name: str) -> str | None:
    """The packaged tables for a GPU name, if any (only the H100 SXM is measured)."""
    key = "".join(c for c in gpu_name.lower() if c.isalnum())
    folder = BUILTIN_KERNEL_GPUS.get(key)
    if folder is None:
        return None
    return str(resources.files("primitives.data") / "kernels" / folder)


# --- uniform log2 grids: the one lookup arithmetic ----------------------------


@dataclass(frozen=True)
class LogGrid:
    """x = 2**(start + i*step) for i in 0..count-1."""

    start: float
    step: float
    count: int

    @property
    def points(self) -> np.ndarray:
        return np.exp2(self.start + self.step * np.arange(self.count))


@dataclass(frozen=True)
class Table1D:
    """log2(latency) sampled on a log2 grid of x."""

    grid: LogGrid
    log2_us: tuple[float, ...]

    @cached_property
    def packed(self) -> tuple[np.ndarray, np.ndarray]:
        """(params, values) as ``primitives.lookup`` takes them."""
        g = self.grid
        return np.array([g.start, g.step, g.count, 0.0]), np.asarray(self.log2_us, dtype=np.float64)

    def __call__(self, x):
        params, values = self.packed
        if np.ndim(x) == 0:
            return lookup1(params, values, float(x))
        return lookup1_array(params, values, np.asarray(x, dtype=np.float64))


@dataclass(frozen=True)
class Table2D:
    """log2(latency) on a log2 grid of x (rows) by a log2 grid of y (columns)."""

    x_grid: LogGrid
    y_grid: LogGrid
    log2_us: tuple[tuple[float, ...], ...]

    @cached_property
    def packed(self) -> tuple[np.ndarray, np.ndarray]:
        g, h = self.x_grid, self.y_grid
        params = np.array([g.start, g.step, g.count, h.start, h.step, h.count, 0.0, 0.0])
        return params, np.asarray(self.log2_us, dtype=np.float64).ravel()

    def __call__(self, x, y):
        params, values = self.packed
        if np.ndim(x) == 0 and np.ndim(y) == 0:
            return lookup2(params, values, float(x), float(y))
        x, y = np.broadcast_arrays(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64))
        return lookup2_array(params, values, np.ascontiguousarray(x), np.ascontiguousarray(y))


TOKEN_GRID = LogGrid(0.0, 0.25, 4 * 17 + 1)  # 1 .. 131,072 tokens
BATCH_GRID = LogGrid(0.0, 0.5, 2 * 10 + 1)  # 1 .. 1,024 requests
CONTEXT_GRID = LogGrid(4.0, 0.5, 2 * 13 + 1)  # 16 .. 131,072 tokens


# --- the measured tables -------------------------------------------------------


def _read_csv(path: Path) -> list[dict[str, str]]:
    """The rows of a kernel table (a regular UTF-8 file with a header and at least one row)."""
    reader = csv.DictReader(io.StringIO(read_text(path), newline=""), strict=True)  # strict: a cut quote fails
    rows = []
    try:
        for row in reader:  # a row short of the header's fields: a file cut mid-row
            missing = [k for k, v in row.items() if k is not None and v is None]
            if missing or None in row:
                got = f"no {', '.join(missing)}" if missing else "more fields than the header names"
                expected = "expected one value per header field (a cut file?)"
                raise InputError(path, f"line {_first_line(reader.line_num, row)}", f"{got}; {expected}")
            rows.append(row)
    except csv.Error as exc:
        raise InputError(path, None, f"not a readable CSV table ({exc})") from None
    if not rows:
        raise InputError(path, None, "expected a header and at least one row of timings")
    return rows


def _first_line(last_line: int, row: dict) -> int:
    """The line a CSV row starts on, from the line it ends on (a quoted value may hold newlines)."""
    values = [v for k, v in row.items() if k is not None and v is not None] + list(row.get(None) or [])
    return last_line - sum(str(v).count("\n") for v in values)


def _table_key(path: Path, parts: int, tp: bool) -> tuple[int, ...]:
    """The head configuration (and TP) a table's file name gives, e.g. 64-8-128-tp4.csv."""
    fields = path.stem.split("-")
    if tp and len(fields) == parts and fields[-1].startswith("tp"):
        fields[-1] = fields[-1][2:]
    example = "64-8-128-tp4.csv (heads-kv_heads-head_dim-tpN)" if tp else "64-8-128.csv (heads-kv_heads-head_dim)"
    if len(fields) != parts or not all(f.isascii() and f.isdigit() and int(f) > 0 for f in fields):
        raise InputError(path, None, f"expected a table name like {example}")
    return tuple(int(f) for f in fields)


def _field(row: dict, key: str, path: Path, count_upper: float | None = None) -> float:
    """A positive finite number of a table's row (``primitives.checks``, as every input);
    with COUNT_UPPER, a count (tokens, requests, matrix elements): whole, at most that."""
    integer = count_upper is not None
    return float(checks.number(row.get(key), path, key, integer=integer, upper=count_upper, text_ok=True))


def _decode_rows(path: Path) -> list[tuple[float, float, float, str]]:
    """(batch, context length, latency µs, KV dtype) of every row of a decode-attention table."""
    rows = []
    for row in _read_csv(path):
        dtype = row.get("kv_dtype", "bf16")  # a table without the column holds bf16 KV
        if dtype not in DTYPE_BYTES:
            raise InputError(path, "kv_dtype", f"expected one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
        rows.append(
            (
                _field(row, "batch_size", path, checks.MAX_REQUESTS),
                _field(row, "kv_len", path, checks.MAX_TOKENS),
                _field(row, "latency_us", path),
                dtype,
            )
        )
    return rows


def _prefill_points(path: Path) -> np.ndarray:
    """(sequence length, latency µs) of a prefill-attention table, by length: at least two
    lengths (below the shortest, the first segment's slope continues)."""
    pts = np.array(
        sorted((_field(r, "seq_len", path, checks.MAX_TOKENS), _field(r, "latency_us", path)) for r in _read_csv(path))
    )
    if len(pts) < 2 or len(np.unique(pts[:, 0])) < len(pts):
        raise InputError(path, "seq_len", "expected timings at two sequence lengths or more, each length once")
    return pts


def _loglog(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Linear in log-log inside [xs[0], xs[-1]] (callers extend outside)."""
    return np.exp2(np.interp(np.log2(x), np.log2(xs), np.log2(ys)))


# A fitted KV price lies between the kernel's typical marginal price (the median, 1.055 on
# H100: a step cannot read its KV for less than the kernel that reads it) and its dear end
# (the 95th percentile, 1.16), which trims single differences' timing noise.
KV_PRICE_FLOOR_QUANTILE = 0.5
KV_PRICE_CAP_QUANTILE = 0.95


class MeasuredKernels:
    """The raw measurements of one GPU, read from a kernels folder."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        gemm_path = self.directory / "gemm.csv"
        if not gemm_path.is_file():
            raise InputError(self.directory, "gemm.csv", "expected a kernels folder with gemm.csv")
        curves: dict[tuple[float, float], list[tuple[float, float]]] = {}
        for row in _read_csv(gemm_path):
            shape = (
                _field(row, "k", gemm_path, checks.MAX_MODEL_DIM),
                _field(row, "n", gemm_path, checks.MAX_MODEL_DIM),
            )
            m = _field(row, "m", gemm_path, checks.MAX_STEP_TOKENS)
            curves.setdefault(shape, []).append((m, _field(row, "latency_us", gemm_path)))
        for (k, n), points in curves.items():  # one latency per matmul shape: interpolation needs a function of m
            ms = [m for m, _ in points]
            if len(set(ms)) < len(ms):
                raise InputError(gemm_path, "m", f"a shape timed twice (k={k:g}, n={n:g}); expected each m once")
        self.gemm = {s: np.array(sorted(v)).T for s, v in curves.items()}
        # every table is read and checked here, once: a bad one is an input error before any work
        self._decode_rows: dict[tuple[int, ...], list[tuple[float, float, float, str]]] = {}
        for p in sorted((self.directory / "attention_decode").glob("*.csv")):
            key = _table_key(p, 4, tp=True)
            self._decode_rows[key] = _decode_rows(p)
        self._prefill: dict[tuple[int, ...], np.ndarray] = {}
        for p in sorted((self.directory / "attention_prefill").glob("*.csv")):
            self._prefill[_table_key(p, 3, tp=False)] = _prefill_points(p)
        self._kv_prices: dict[float, list[float]] = {}  # HBM bytes/µs -> marginal KV byte prices
        for folder, tables in (("attention_decode", self._decode_rows), ("attention_prefill", self._prefill)):
            if not tables:
                raise InputError(self.directory, folder, "expected a folder of attention tables (*.csv) here")

    # matmul ----------------------------------------------------------------
    def gemm_us(self, m: np.ndarray, k: float, n: float) -> np.ndarray:
        m = np.asarray(m, dtype=np.float64)
        shape = min(self.gemm, key=lambda s: (math.log(s[0] / k) ** 2 + math.log(s[1] / n) ** 2, s))
        ms, lat = self.gemm[shape]
        inside = _loglog(np.clip(m, ms[0], ms[-1]), ms, lat)
        above = lat[-1] * m / ms[-1]  # compute bound beyond the largest measured m
        us = np.where(m > ms[-1], above, inside)
        return np.where(m > 0, us * (k * n) / (shape[0] * shape[1]), 0.0)

    # attention -------------------------------------------------------------
    def _nearest(self, table: dict, q_per_gpu: float, kv_per_gpu: float, head_dim: int, tp: int | None):
        def distance(key):
            h, kv, d = key[:3]
            t = key[3] if len(key) > 3 else 1
            return (d != head_dim, abs(math.log(h / t / q_per_gpu)) + abs(math.log(kv / t / kv_per_gpu)), key)

        candidates = [k for k in table if tp is None or len(k) == 3 or k[3] == tp] or list(table)
        return min(candidates, key=distance)

    def decode_us(self, n_heads: int, n_kv_heads: int, head_dim: int, tp: int, batch, context):
        """(len(batch), len(context)) per-layer latencies, and the table's launch floor."""
        key = (n_heads, n_kv_heads, head_dim, tp)
        if key not in self._decode_rows:
            key = self._nearest(self._decode_rows, n_heads / tp, n_kv_heads / tp, head_dim, None)
        scale = (n_kv_heads / tp) / (key[1] / key[3])
        rows: dict[float, list[tuple[float, float]]] = {}
        for b, context_len, latency, _ in self._decode_rows[key]:
            rows.setdefault(b, []).append((context_len, latency))
        floor = min(v for pts in rows.values() for _, v in pts)
        batches = np.array(sorted(rows))
        context = np.asarray(context, dtype=np.float64)

        def along_context(b: float) -> np.ndarray:
            kvs, lat = np.array(sorted(rows[b])).T
            inside = _loglog(np.clip(context, kvs[0], kvs[-1]), kvs, lat)
            slope = (lat[1] - lat[0]) / (kvs[1] - kvs[0]) if len(kvs) > 1 else 0.0
            below = np.maximum(floor, lat[0] - slope * (kvs[0] - context))
            above = lat[-1] * context / kvs[-1]
            return np.where(context < kvs[0], below, np.where(context > kvs[-1], above, inside))

        per_batch = np.array([along_context(b) for b in batches])  # (measured batches, contexts)
        out = np.empty((len(batch), len(context)))
        for i, b in enumerate(np.asarray(batch, dtype=np.float64)):
            if b >= batches[-1]:
                out[i] = per_batch[-1] * b / batches[-1]  # memory bound beyond the largest batch
            else:
                lb = np.log2(max(b, batches[0]))
                out[i] = np.exp2([np.interp(lb, np.log2(batches), np.log2(col)) for col in per_batch.T])
        return np.maximum(floor, out * scale), floor

    def prefill_us(self, n_heads: int, n_kv_heads: int, head_dim: int, tp: int, seq_len) -> np.ndarray:
        key = (n_heads, n_kv_heads, head_dim)
        if key not in self._prefill:
            key = self._nearest(self._prefill, float(n_heads), float(n_kv_heads), head_dim, None)
        ss, lat = self._prefill[key].T
        s = np.asarray(seq_len, dtype=np.float64)
        first_slope = math.log(lat[1] / lat[0]) / math.log(ss[1] / ss[0])
        inside = _loglog(np.clip(s, ss[0], ss[-1]), ss, lat)
        below = lat[0] * (s / ss[0]) ** first_slope
        above = lat[-1] * (s / ss[-1]) ** 2
        us = np.where(s < ss[0], below, np.where(s > ss[-1], above, inside))
        return us * (n_heads / key[0]) / tp

    # the price of a KV byte ----------------------------------------------------
    def kv_byte_price(self, hbm_bytes_per_us: float, quantile: float = KV_PRICE_CAP_QUANTILE) -> float:
        """What one more KV byte costs in the measured decode-attention kernel, per µs of
        its HBM roofline time (the ``quantile`` of every table's marginal prices).

        A marginal price is the latency added by lengthening a batch's context to the next
        measured length, over the roofline time of the bytes it adds (K and V of the KV heads each GPU holds, per
        layer), counted only where that roofline time is at least ``MEMORY_BOUND_STEP_US``:
        there bandwidth, not the launch, is what grows. The launch floor is a per-call cost
        that a step's overhead terms carry, so a ratio of latency to roofline would count it
        twice. On H100 the prices are 1.04-1.07 (median per table) for every head
        configuration and TP; the quantile trims the timing noise of single differences.
        The prices are read once per bandwidth (the cap and the floor take two quantiles).
        """
        if hbm_bytes_per_us not in self._kv_prices:
            self._kv_prices[hbm_bytes_per_us] = self._marginal_kv_prices(hbm_bytes_per_us)
        prices = self._kv_prices[hbm_bytes_per_us]
        if not prices:
            raise InputError(self.directory, "attention_decode", "no memory-bound decode timings to price a KV byte")
        return float(np.quantile(prices, quantile))

    def _marginal_kv_prices(self, hbm_bytes_per_us: float) -> list[float]:
        """Every decode table's marginal prices of a KV byte (``kv_byte_price``)."""
        prices = []
        for (_, kv, d, tp), table in sorted(self._decode_rows.items()):
            rows: dict[tuple[float, float], list[tuple[float, float]]] = {}  # (batch, bytes/token) -> points
            for b, context_len, latency, dtype in table:
                bytes_per_token = 2 * kv / tp * d * DTYPE_BYTES[dtype]
                rows.setdefault((b, bytes_per_token), []).append((context_len, latency))
            for (b, bytes_per_token), pts in rows.items():
                pts.sort()
                for (c0, t0), (c1, t1) in pairwise(pts):
                    roofline_us = b * (c1 - c0) * bytes_per_token / hbm_bytes_per_us
                    if roofline_us >= MEMORY_BOUND_STEP_US:
                        prices.append((t1 - t0) / roofline_us)
        return prices


MEMORY_BOUND_STEP_US = 20.0  # about the launch floor: a smaller step is timing noise on top of it
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}


def _kv_byte_prices(gpus, quantile: float) -> list[float]:
    prices = []
    for g in gpus:
        if g.kernel_dir is None:
            continue
        try:
            prices.append(measured_kernels(g.kernel_dir).kv_byte_price(g.hbm_bytes_per_s / 1e6, quantile))
        except InputError:  # only short contexts or small batches measured
            continue
    return prices


def efficiency_caps(gpus) -> dict[str, float]:
    """Upper bounds of µs primitives' efficiencies that the GPUs' measured kernels price
    (``fitness.efficiency``): ``kv_io_time_us``, at the dearest of the GPUs' KV byte prices;
    ``decode_attention_time_us`` (the measured kernel itself, whose KV byte costs its typical
    price) at that cap over the cheapest typical price, so that a KV byte has one price
    whichever primitive carries it. GPUs without measured kernels, or whose decode tables are
    all launch-bound (no KV price to read), add nothing."""
    prices = _kv_byte_prices(gpus, KV_PRICE_CAP_QUANTILE)
    if not prices:
        return {}
    cap = round(max(prices), 4)
    return {"decode_attention_time_us": round(cap / efficiency_floors(gpus)["kv_io_time_us"], 4), "kv_io_time_us": cap}


def efficiency_floors(gpus) -> dict[str, float]:
    """Lower bounds of the same: ``kv_io_time_us`` at the cheapest of the GPUs' typical
    (median) KV byte prices; nothing where no GPU has one."""
    prices = _kv_byte_prices(gpus, KV_PRICE_FLOOR_QUANTILE)
    return {"kv_io_time_us": round(min(prices), 4)} if prices else {}


@lru_cache(maxsize=8)
def measured_kernels(directory: str) -> MeasuredKernels:
    return MeasuredKernels(directory)


@dataclass(frozen=True)
class KernelTables:
    """One deployment's step-cost lookups (all layers, per GPU); see the module doc."""

    gemm: Table1D
    decode_attention: Table2D
    prefill_attention: Table1D

    def functions(self) -> dict:
        """The lookups under the names the primitive registry calls them by."""
        return {
            "kernel_gemm_us": self.gemm,
            "kernel_decode_attention_us": self.decode_attention,
            "kernel_prefill_attention_us": self.prefill_attention,
        }


def _monotone(values: np.ndarray, axis: int) -> np.ndarray:
    """Each point lowered to the fastest time at more work along ``axis``."""
    flipped = np.flip(values, axis=axis)
    return np.flip(np.minimum.accumulate(flipped, axis=axis), axis=axis)


def _log2_table(values: np.ndarray) -> tuple:
    values = _monotone(np.maximum(values, 1e-6), axis=-1)
    return tuple(np.log2(values).round(9).tolist())


def step_matmul_us(kernels: MeasuredKernels, model, tp: int, tokens: np.ndarray) -> np.ndarray:
    """Every projection of every layer at m = tokens, per GPU (Megatron-style TP shards)."""
    h, d = model.hidden_size, model.head_dim
    q_o = model.n_heads * d
    qkv = (model.n_heads + 2 * model.n_kv_heads) * d
    per_layer = kernels.gemm_us(tokens, h, qkv / tp) + kernels.gemm_us(tokens, q_o / tp, h)
    inter = model.intermediate_size
    if model.is_moe:
        e, k = model.n_experts, model.experts_per_tok
        touched = e * (1.0 - (1.0 - k / e) ** tokens)  # expected experts hit by top-k routing
        per_expert = tokens * k / np.maximum(touched, 1e-9)
        experts = kernels.gemm_us(per_expert, h, 2 * inter / tp) + kernels.gemm_us(per_expert, inter / tp, h)
        per_layer = per_layer + touched * experts + kernels.gemm_us(tokens, h, e)
    else:
        per_layer = per_layer + kernels.gemm_us(tokens, h, 2 * inter / tp) + kernels.gemm_us(tokens, inter / tp, h)
    return model.n_layers * per_layer


@lru_cache(maxsize=64)
def kernel_tables(directory: str, model, tp: int) -> KernelTables:
    """The lookups of one (model, TP) on the GPU whose kernels are in ``directory``."""
    k = measured_kernels(directory)
    tokens = TOKEN_GRID.points
    gemm = Table1D(TOKEN_GRID, _log2_table(step_matmul_us(k, model, tp, tokens)))
    heads = (model.n_heads, model.n_kv_heads, model.head_dim, tp)
    decode, _ = k.decode_us(*heads, BATCH_GRID.points, CONTEXT_GRID.points)
    decode = _monotone(decode * model.n_layers, axis=0)  # monotone in batch, then in context
    decode_t = Table2D(BATCH_GRID, CONTEXT_GRID, tuple(_log2_table(row) for row in decode))
    prefill = k.prefill_us(*heads, tokens) * model.n_layers
    return KernelTables(gemm, decode_t, Table1D(TOKEN_GRID, _log2_table(prefill)))
