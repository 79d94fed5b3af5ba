"""The kernel floor on every catalog deployment: a model's step time against the measured
kernels it runs, where the export ships it (``archive show``, ``archive best``, ``export-go``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from archive.entry import ArchiveEntry, entry_id_for
from archive.rundir import record_latest
from archive.store import ArchiveStore
from evolve.cli import main
from evolve.kernel_floor_view import below_floor, floor_note
from fitness.physics_check import kernel_floor_by_deployment
from primitives.deployment import CATALOG_TPS, default_resolver

KERNELS = "gemm_time_us + decode_attention_time_us + prefill_attention_time_us"


def _deployments():
    r = default_resolver()
    return r.catalog_deployments(r.resolve("meta-llama/Llama-2-70b-hf", 4))


def test_the_catalog_is_every_model_at_every_tp_its_heads_allow():
    deps = _deployments()
    assert (deps[0].model.name, deps[0].tp) == ("Llama-2-70b-hf", 4)  # the primary first
    assert len({(d.model.name, d.tp) for d in deps}) == len(deps) == 4 * len(CATALOG_TPS)


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_the_ratio_is_the_step_time_over_the_kernels_it_runs(factor):
    deps = _deployments()
    ratios = kernel_floor_by_deployment(f"{factor}*({KERNELS})", deps)
    fits = [r for d, r in ratios if r is not None]
    # Llama-2-70B and Mixtral do not fit one GPU: no probe, no ratio
    assert [(d.model.name, d.tp) for d, r in ratios if r is None] == [("Llama-2-70b-hf", 1), ("Mixtral-8x7B-v0.1", 1)]
    assert fits == pytest.approx([factor] * len(fits), rel=1e-9)


def test_a_constant_in_place_of_weight_streaming_fails_where_the_weights_differ():
    """The trace command's kind of model: a fixed 7.5 ms where two deployments of about 34 GB
    per GPU stream their weights, and matmuls priced by their FLOPs alone."""
    deps = _deployments()
    expr = "7518.56 + 1*decode_attention_time_us + 1*matmul_time_us + 46.3855*allreduce_calls"
    low = below_floor(kernel_floor_by_deployment(expr, deps))
    assert [(d.model.name, d.tp) for d, _ in low][:1] == [("CodeLlama-34b-Instruct-hf", 1)]  # 68 GB on one GPU
    assert ("Mixtral-8x7B-v0.1", 2) in {(d.model.name, d.tp) for d, _ in low}
    assert [r for _, r in low] == sorted(r for _, r in low) and all(r < 1 for _, r in low)
    note = floor_note(kernel_floor_by_deployment(expr, deps), "abc")
    assert note.startswith("warning: on CodeLlama-34b-Instruct-hf TP1 (0.50x), ")
    assert "abc prices some steps below the measured kernels" in " ".join(note.split())
    assert all(len(line) <= 80 for line in note.splitlines())
    assert floor_note(kernel_floor_by_deployment(f"1.1*({KERNELS})", deps), "abc") is None
    assert floor_note(None, "abc") is None


def _project(tmp_path: Path, expression: str, run_config: dict | None = None) -> None:
    """A finished run on the embedded default data whose front is one entry."""
    e = ArchiveEntry(
        id=entry_id_for(expression),
        expression=expression,
        simplified=None,
        complexity=5,
        constants=[],
        generation=1,
        objectives={"step_mape": 0.05, "complexity": 5},
        primitives=["gemm_time_us"],
    )
    run_dir = tmp_path / "runs" / "r"
    with ArchiveStore(run_dir / "archive.sqlite") as store:
        store.start_run("r", run_config or {}, 0, "fp")
        store.record_generation("r", 1, [e], [e], {})
        store.finish_run("r", {"generations": 1})
    record_latest(run_dir)


def test_archive_show_best_and_export_say_where_a_model_is_faster_than_its_kernels(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    expression = f"0.5*({KERNELS})"
    _project(tmp_path, expression)
    eid = entry_id_for(expression)
    assert main(["archive", "show", eid]) == 0
    out = capsys.readouterr().out
    assert "Step time over the measured kernels" in out and "0.50 !" in out and "Mixtral-8x7B-v0.1" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert main(["archive", "best"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert f"{eid} prices some steps below the measured kernels" in flat and "Llama-2-7b-hf TP8 (0.50x)" in flat
    # --out bakes in one deployment: the warning names that one alone
    args = ["export-go", eid, "--out", "go", "--model", "mistralai/Mixtral-8x7B-v0.1", "--tp", "4"]
    assert main(args) == 0
    warning = " ".join(capsys.readouterr().out.split("warning:")[1].split())
    assert warning.startswith("on Mixtral-8x7B-v0.1 TP4 (0.50x), ") and "Llama" not in warning


def test_a_model_that_pays_for_its_kernels_gets_no_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, f"1.2*({KERNELS})")
    assert main(["archive", "best"]) == 0
    assert "warning" not in capsys.readouterr().out


def test_a_catalog_model_whose_heads_a_tp_does_not_divide_is_skipped_at_that_tp():
    from primitives.deployment import BUILTIN_MODEL_CONFIGS, DeploymentResolver, ModelCatalog

    catalog = ModelCatalog.builtin()
    cfg = dict(BUILTIN_MODEL_CONFIGS["meta-llama/Llama-2-7b-hf"], num_attention_heads=20, num_key_value_heads=20)
    cfg["hidden_size"] = 20 * 128
    catalog.add("small/Small-20h", cfg, "<test>")
    r = DeploymentResolver(catalog=catalog)
    deps = r.catalog_deployments(r.resolve("meta-llama/Llama-2-70b-hf", 4))
    small = {d.tp for d in deps if d.model.name == "Small-20h"}
    assert small == {1, 2, 4}  # 20 heads: not at TP 8 (the resolver would refuse it)


def test_the_view_never_stops_a_command(tmp_path, monkeypatch, capsys):
    """An expression sympy cannot price: no note. A damaged run record: the note from the
    kernels themselves. Neither stops the command."""
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, "1/0 + gemm_time_us")
    assert main(["archive", "best"]) == 0 and "warning" not in capsys.readouterr().out
    _project(tmp_path / "b", f"0.5*({KERNELS})", run_config={"efficiency_bounds": "abc", "efficiency_caps": [1]})
    assert main(["archive", "best", "--run-dir", "b/runs/r"]) == 0
    assert "prices some steps below" in capsys.readouterr().out


def test_the_ratio_is_against_the_kernels_whatever_the_runs_bounds(tmp_path, monkeypatch, capsys):
    """A run searched with --efficiency-bounds 0.5,4 may hold a model at 0.6 of its kernels:
    the view still says so (the title speaks of the kernels themselves)."""
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, f"0.6*({KERNELS})", run_config={"efficiency_bounds": [0.5, 4.0]})
    assert main(["archive", "best"]) == 0
    assert "(0.60x)" in capsys.readouterr().out


def test_an_archived_expression_that_is_not_arithmetic_is_damage_and_never_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _project(tmp_path, f"0.5*({KERNELS})")
    archive = tmp_path / "runs" / "r" / "archive.sqlite"
    import sqlite3

    evil = "open('pwned', 'w').write('1') + gemm_time_us"
    with sqlite3.connect(archive) as db:
        (row,) = db.execute("SELECT id, payload FROM entries").fetchall()
        db.execute("UPDATE entries SET payload = ?", (row[1].replace(f"0.5*({KERNELS})", evil),))
    for cmd in (["archive", "show", row[0]], ["archive", "best"], ["archive", "list"]):
        assert main(cmd) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "damaged" in line and "not a step-time expression" in line
    assert not (tmp_path / "pwned").exists()


def test_the_view_prices_with_the_runs_own_kernel_tables(tmp_path, monkeypatch, capsys):
    """A run made with --kernels DIR is judged against those tables, not the built-in ones."""
    import csv
    import shutil

    monkeypatch.chdir(tmp_path)
    tables = tmp_path / "k2"
    shutil.copytree(Path(__file__).resolve().parents[1] / "primitives" / "data" / "kernels" / "h100", tables)
    gemm = tables / "gemm.csv"
    rows = list(csv.DictReader(gemm.open()))
    column = next(k for k in rows[0] if "us" in k or "latency" in k)
    for row in rows:
        row[column] = str(2 * float(row[column]))  # every matmul twice as slow
    with gemm.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    roofline = "2.7*(weight_time_us + matmul_time_us + kv_io_time_us + attention_time_us)"  # no kernel in it
    _project(tmp_path, roofline)
    assert main(["archive", "best"]) == 0 and "warning" not in capsys.readouterr().out  # the built-in tables
    _project(tmp_path / "b", roofline, run_config={"kernels": str(tables)})
    assert main(["archive", "best", "--run-dir", "b/runs/r"]) == 0
    assert "prices some steps below the measured kernels" in " ".join(capsys.readouterr().out.split())


def test_a_run_ends_with_the_note_for_the_model_it_recommends(tmp_path, monkeypatch, capsys):
    from evolve.kernel_floor_view import print_run_floor_note

    monkeypatch.chdir(tmp_path)
    _project(tmp_path, f"0.5*({KERNELS})")
    print_run_floor_note(tmp_path / "runs" / "r")
    assert "prices some steps below the measured kernels" in " ".join(capsys.readouterr().out.split())
    print_run_floor_note(tmp_path / "nowhere")  # interrupted before its first front: nothing to say
    assert capsys.readouterr().out == ""


def test_the_search_holds_the_floor_on_every_deployment_the_export_ships():
    """Two traced deployments that each stream about 34 GB of weights per GPU cannot tell weight
    streaming from a constant; the kernels of the catalog's other deployments can."""
    from evolve.config import RunConfig
    from evolve.run import prepare_context
    from fitness.physics_check import probe_check
    from fitness.physics_probes import probe_batches

    r = default_resolver()
    traced = [r.resolve("meta-llama/Llama-2-70b-hf", 4), r.resolve("codellama/CodeLlama-34b-Instruct-hf", 2)]
    probed = r.with_catalog(traced)
    assert probed[:2] == traced  # the data's deployments first, then each catalog one once
    assert sorted(d.key for d in probed) == sorted(d.key for d in _deployments())
    # the trace command's model before the rule: a 7.5 ms constant where weights stream
    constant = "7518.56 + decode_attention_time_us + matmul_time_us + 46.3855*allreduce_calls"
    assert probe_check(constant, traced, 1.0)["kernel_floor_ratio_min"] > 1.2
    assert probe_check(constant, probed, 1.0)["kernel_floor_ratio_min"] < 0.6  # CodeLlama-34B at TP1
    ctx, _, _ = prepare_context(RunConfig(generations=1), r)  # the run's probes: the catalog too
    assert len(ctx.probes.floor_us) >= len(probe_batches()) * len(_deployments())


def test_one_build_per_gpu_gives_each_deployment_its_own_ratio():
    """The probes are built once per GPU, not once per deployment: the same ratios as each
    deployment alone, and a GPU without measured kernels has none while the H100's keep theirs."""
    from dataclasses import replace

    from fitness.physics_check import probe_check

    r = default_resolver()
    h100 = _deployments()[:5]
    bare = r.gpu(None)
    r.gpus["bare"] = replace(bare, name="bare", kernel_dir=None)  # a datasheet without kernel tables
    other = r.resolve("meta-llama/Llama-2-7b-hf", 1, "bare")
    expr = "1.2*matmul_time_us + 1.1*weight_time_us + 1.1*kv_io_time_us + 1500*tp"  # no kernel tables needed
    got = kernel_floor_by_deployment(expr, [h100[0], other, *h100[1:]])
    alone = [probe_check(expr, [d], 1.0)["kernel_floor_ratio_min"] for d in h100]
    assert [v for _, v in got] == [alone[0], None, *alone[1:]]
    assert sum(v is not None for v in alone) >= 4  # the H100 deployments that fit a probe have a ratio
