"""Memoised scoring of candidates, with the parallelism as a pluggable map.

A map scores a list of programs against the fitness context and returns their scores
in order: ``SerialMap`` in this process, ``LokyMap`` in a joblib/loky pool, ``DaskMap``
on a Dask cluster (``evolve.cluster``). The fitness context (tens of MB of columns)
reaches each worker once: loky workers read it from a pickle in a temporary directory,
Dask workers get it scattered. Every map returns the same scores in the same order, so
the front of a seed does not depend on the backend or the number of workers.
"""

from __future__ import annotations

import os
import pickle
import tempfile

from fitness.scoring import FitnessContext, Score, score_many
from primitives.language import Program, canonical

_WORKER_CONTEXTS: dict[str, FitnessContext] = {}


def score_chunk_from_file(context_path: str, programs: list[Program]) -> list[Score]:
    """Worker side of the loky pool: load the fitness context once per worker, then score."""
    ctx = _WORKER_CONTEXTS.get(context_path)
    if ctx is None:
        with open(context_path, "rb") as fh:
            ctx = pickle.load(fh)
        _WORKER_CONTEXTS.clear()
        _WORKER_CONTEXTS[context_path] = ctx
    return score_many(programs, ctx)


def _chunked(score_chunks, programs: list[Program], jobs: int) -> list[Score]:
    """Deal the programs round-robin into ``4 * jobs`` chunks, score them, reassemble in order."""
    n_chunks = min(len(programs), jobs * 4)
    chunks = [programs[i::n_chunks] for i in range(n_chunks)]
    scores: list = [None] * len(programs)
    for i, res in enumerate(score_chunks(chunks)):
        scores[i::n_chunks] = res
    return scores


class SerialMap:
    """Scoring in this process."""

    def __init__(self, ctx: FitnessContext):
        self.ctx = ctx

    def __call__(self, programs: list[Program]) -> list[Score]:
        return score_many(programs, self.ctx)

    def close(self, *exc) -> None:
        pass


class LokyMap:
    """Scoring in a loky process pool; workers read the context from a temporary pickle."""

    def __init__(self, ctx: FitnessContext, jobs: int):
        from joblib import Parallel

        self.jobs = jobs
        self._tmp = tempfile.TemporaryDirectory(prefix="stepsynth-ctx-")
        self._ctx_path = os.path.join(self._tmp.name, "context.pkl")
        with open(self._ctx_path, "wb") as fh:
            pickle.dump(ctx, fh, protocol=pickle.HIGHEST_PROTOCOL)
        self._parallel = Parallel(n_jobs=jobs, backend="loky")
        self._parallel.__enter__()

    def __call__(self, programs: list[Program]) -> list[Score]:
        from joblib import delayed

        def score_chunks(chunks):
            return self._parallel(delayed(score_chunk_from_file)(self._ctx_path, c) for c in chunks)

        return _chunked(score_chunks, programs, self.jobs)

    def close(self, *exc) -> None:
        self._parallel.__exit__(*exc)
        self._tmp.cleanup()


class DaskMap:
    """Scoring on a Dask cluster (``--scheduler``, or a private local one); the context is scattered."""

    def __init__(self, ctx: FitnessContext, jobs: int, scheduler: str | None):
        from joblib import Parallel, parallel_config

        from evolve.cluster import dask_client

        self.ctx = ctx
        self.jobs = jobs
        self._client = dask_client(scheduler, jobs)
        self._cfg = parallel_config(backend="dask", scatter=[ctx])
        self._cfg.__enter__()
        self._parallel = Parallel(n_jobs=-1)
        self._parallel.__enter__()

    def __call__(self, programs: list[Program]) -> list[Score]:
        from joblib import delayed

        from evolve.cluster import preserve_random_state  # dask consumes global random

        def score_chunks(chunks):
            with preserve_random_state():
                return self._parallel(delayed(score_many)(c, self.ctx) for c in chunks)

        return _chunked(score_chunks, programs, self.jobs)

    def close(self, *exc) -> None:
        self._parallel.__exit__(*exc)
        self._cfg.__exit__(*exc)
        self._client.close()


def open_map(ctx: FitnessContext, jobs: int, backend: str, scheduler: str | None):
    """The map for ``--backend`` and ``--jobs``: Dask, a loky pool for several jobs, else serial."""
    if backend == "dask":
        return DaskMap(ctx, jobs, scheduler)
    if jobs > 1:
        return LokyMap(ctx, jobs)
    return SerialMap(ctx)


class Evaluator:
    """Memoised scoring of programs (by canonical form) through a map; a context manager."""

    def __init__(self, ctx: FitnessContext, jobs: int, backend: str = "loky", scheduler: str | None = None):
        self.ctx = ctx
        self.jobs = max(1, int(jobs))
        self.backend = backend
        self.scheduler = scheduler
        self.memo: dict[str, Score] = {}  # since the last reset
        # the copy of each canonical form that was scored (since the last reset): a fit follows
        # its program's term order, so mirrored copies differ in the last bits; a resumed run
        # scores the copy the interrupted one did (the checkpoint carries these)
        self.scored_copies: dict[str, Program] = {}
        self.seen: set[str] = set()  # every candidate scored by this evaluator, across resets
        self._map = None

    def __enter__(self):
        self._map = open_map(self.ctx, self.jobs, self.backend, self.scheduler)
        return self

    def __exit__(self, *exc):
        if self._map is not None:
            self._map.close(*exc)
            self._map = None
        return False

    def reset(self, ctx: FitnessContext) -> None:
        """Score against a new context (refreshed trajectories): new map, empty memo."""
        self.__exit__(None, None, None)
        self.ctx = ctx
        self.memo.clear()
        self.scored_copies.clear()
        self.__enter__()

    def scores_kept(self) -> tuple:
        """What ``reset`` forgets (context, memo, scored copies), to ``restore`` if a rescoring is cut short."""
        return self.ctx, dict(self.memo), dict(self.scored_copies)

    def restore(self, kept: tuple) -> None:
        """The context and scores of ``scores_kept`` again (the workers keep the newer rows: no
        pool restart while an interrupt unwinds)."""
        self.ctx, self.memo, self.scored_copies = kept  # scores_kept made them copies

    def score(self, programs: list[Program]) -> list[Score]:
        keys = [canonical(p) for p in programs]
        todo: dict[str, Program] = {}
        for k, p in zip(keys, programs, strict=True):
            if k not in self.memo and k not in todo:
                todo[k] = self.scored_copies.setdefault(k, p)
        if todo:
            items = list(todo.items())
            progs = [p for _, p in items]
            scores = self._map(progs) if self._map is not None else score_many(progs, self.ctx)
            for (k, _), s in zip(items, scores, strict=True):
                self.memo[k] = s
            self.seen.update(todo)
        return [self.memo[k] for k in keys]
