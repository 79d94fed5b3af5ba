"""Scale-out of candidate scoring with Dask (``python -m evolve run --backend dask``).

``dask_client(address, jobs)`` returns a ``distributed.Client``: connected to the
scheduler at ``address`` (``--scheduler tcp://host:8786``), or, without an address, to
a private local cluster of ``jobs`` worker *processes* with one thread each (scoring
is numpy-heavy Python, so threads would fight over the GIL). The local cluster is
owned by the client: ``client.close()`` stops its workers too.

The search itself stays deterministic: joblib's dask backend returns results in
submission order, and every candidate is scored by the same pure function, so the
front of a seed does not depend on the backend or on the number of workers.
"""

from __future__ import annotations

import logging
import os
import random
from contextlib import contextmanager

from primitives.errors import InputError

CONNECT_TIMEOUT_S = 10.0  # how long to wait for a scheduler before giving up
# distributed logs every worker start/stop at INFO and some shutdown noise at WARNING
_NOISY_LOGGERS = (
    "distributed",
    "distributed.scheduler",
    "distributed.nanny",
    "distributed.worker",
    "distributed.core",
    "distributed.comm",
    "distributed.batched",
    "distributed.http",
)


@contextmanager
def preserve_random_state():
    """Keep Python's global ``random`` stream untouched by Dask's own use of it.

    DEAP draws every variation from the global ``random`` module, and so does
    ``distributed`` (``utils_comm.gather_from_workers`` calls ``random.choice`` once per
    result key, in the client process when the scheduler runs there, as in a
    ``LocalCluster``). Without this, a dask run of a seed diverges from the serial one
    after the first scored generation. Wrap every blocking dask call of the search in it.
    """
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)


def _silence_logs(level: int = logging.ERROR) -> None:
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(level)


def _workers(jobs: int) -> int:
    if jobs is None or jobs < 1:  # -1: every core
        return max(1, os.cpu_count() or 1)
    return int(jobs)


def dask_client(address: str | None, jobs: int):
    """A ``distributed.Client`` for ``address``, or one owning a local process cluster.

    A missing ``distributed`` package, an unreachable scheduler or a malformed address
    is an ``InputError`` naming ``--scheduler`` (or ``--backend``), never a traceback.
    """
    try:
        import distributed
    except ImportError:
        raise InputError(
            "--backend", "dask", "the dask backend needs the 'distributed' package (pip install 'dask[distributed]')"
        ) from None
    _silence_logs()
    if address:
        address = address.strip()
        try:
            return distributed.Client(address, timeout=CONNECT_TIMEOUT_S, set_as_default=True)
        except (OSError, TimeoutError, ValueError, TypeError) as exc:
            # OSError covers refused connections and distributed's "Timed out trying to connect"
            reason = " ".join(str(exc).split())[:160] or type(exc).__name__
            raise InputError(
                address,
                "--scheduler",
                f"cannot connect to a dask scheduler ({reason}); expected an address such as tcp://127.0.0.1:8786",
            ) from None
    try:
        # no address: a client-owned LocalCluster, closed with the client
        return distributed.Client(
            n_workers=_workers(jobs),
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=logging.ERROR,
            set_as_default=True,
        )
    except (OSError, TimeoutError) as exc:
        reason = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise InputError(
            "--backend",
            "dask",
            f"cannot start a local dask cluster ({reason}); pass --scheduler ADDRESS of a running scheduler instead",
        ) from None
