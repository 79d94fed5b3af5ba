"""Scale-out with Dask: same seed -> same front as serial and loky scoring.

A real ``distributed.LocalCluster`` with worker processes is started here; the search
connects to it by address (what ``--scheduler`` does). The CLI test lets
``evolve.cluster.dask_client`` start its own local cluster.
"""

import json
import random
import socket
from pathlib import Path

import pytest

distributed = pytest.importorskip("distributed")

from conftest import small_trace  # noqa: E402
from error_lines import run_evolve  # noqa: E402
from test_search import planted_table  # noqa: E402

from evolve.config import RunConfig  # noqa: E402
from evolve.evaluator import Evaluator  # noqa: E402
from evolve.search import Search  # noqa: E402
from fitness.scoring import FitnessContext  # noqa: E402
from primitives.errors import InputError  # noqa: E402
from primitives.language import canonical  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=40
    ) as c:
        yield c


def _front(jobs: int, backend: str = "loky", scheduler: str | None = None, seed: int = 3):
    table = planted_table(n=1500)
    ctx = FitnessContext(table)
    cfg = RunConfig(generations=4, population=40, seed=seed, jobs=jobs, backend=backend, scheduler=scheduler)
    with Evaluator(ctx, jobs, backend, scheduler) as ev:
        s = Search(cfg, ctx, table.primitive_names, ev)
        s.initialise()
        for _ in range(cfg.generations):
            s.step()
        return [
            (canonical(p), sc.train_error, sc.complexity, tuple(sc.coefficients), sc.intercept) for p, sc in s.front()
        ]


def test_dask_front_equals_serial_and_loky(cluster):
    serial = _front(1)
    assert serial, "the search found no front"
    assert _front(2, "loky") == serial
    assert _front(2, "dask", cluster.scheduler_address) == serial  # bit-equal, not approximately


def test_dask_scoring_leaves_the_global_random_stream_alone(cluster):
    # distributed calls random.choice while gathering results; DEAP draws from the same stream
    table = planted_table(n=300)
    progs = [(("var", n),) for n in table.primitive_names[:6]]
    with Evaluator(FitnessContext(table), 2, "dask", cluster.scheduler_address) as ev:
        random.seed(11)
        before = random.getstate()
        scores = ev.score(progs)
        assert random.getstate() == before
    assert len(scores) == len(progs)


def test_unreachable_scheduler_is_an_input_error_naming_the_option(monkeypatch):
    import evolve.cluster as cl

    monkeypatch.setattr(cl, "CONNECT_TIMEOUT_S", 1.0)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(InputError, match="--scheduler"):
        cl.dask_client(f"tcp://127.0.0.1:{port}", 1)
    with pytest.raises(InputError, match="--scheduler"):
        cl.dask_client("nonsense://nowhere", 1)


def _tiny_trace(path: Path) -> None:
    small_trace().to_csv(path, index=False)


def test_cli_backend_dask_starts_a_local_cluster_and_matches_loky(tmp_path):
    _tiny_trace(tmp_path / "trace.csv")
    common = ["--generations", "3", "--population", "30", "--data", "trace.csv", "--seed", "5"]
    res = run_evolve(
        tmp_path, "run", *common, "--backend", "dask", "--jobs", "2", "--run-dir", "runs/dask", timeout=180
    )
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    res = run_evolve(tmp_path, "run", *common, "--run-dir", "runs/serial", timeout=180)
    assert res.returncode == 0, res.stderr
    fronts = []
    for name in ("dask", "serial"):
        out = run_evolve(tmp_path, "archive", "list", "--json", "--run-dir", f"runs/{name}", timeout=180)
        assert out.returncode == 0, out.stderr
        fronts.append([(e["id"], e["expression"], e["objectives"]) for e in json.loads(out.stdout)])
    assert fronts[0] and fronts[0] == fronts[1]
