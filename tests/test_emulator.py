"""The synthetic vLLM emulator and the embedded default dataset it generated."""

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from fitness.emulator.cli import main
from fitness.emulator.experiment import DEFAULT_SEED, REQUEST_COLUMNS, generate_experiment
from fitness.emulator.generate import (
    DEFAULT_DATA_DIR,
    GENERATOR_VERSION,
    METADATA_FILE,
    STEP_REQUESTS_FILE,
    STEP_TRACES_FILE,
    frame_digest,
)
from fitness.emulator.physics import EmulatorPhysics, HiddenPhysics, expected_noise_floor_mape
from fitness.emulator.server import EmulatedVLLM
from fitness.emulator.workloads import (
    SERVED_MODELS,
    WORKLOADS,
    all_experiments,
    experiment_id,
    experiment_spec,
)
from primitives.data.experiments import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from primitives.deployment import DeploymentResolver

DATA = DEFAULT_DATA_DIR
# The real traces' flat schema (shared/data/steps/step_traces.parquet), in order.
REAL_COLUMNS = [
    "experiment_id",
    "model",
    "workload",
    "tp",
    "step.id",
    "step.ts_start_ns",
    "step.ts_end_ns",
    "step.duration_us",
    "queue.running_depth",
    "queue.waiting_depth",
    "batch.num_prefill_reqs",
    "batch.num_decode_reqs",
    "batch.scheduled_tokens",
    "batch.prefill_tokens",
    "batch.decode_tokens",
    "batch.num_finished",
    "batch.num_preempted",
    "kv.usage_gpu_ratio",
    "kv.blocks_total_gpu",
    "kv.blocks_free_gpu",
]


@pytest.fixture(scope="module")
def steps() -> pd.DataFrame:
    return pd.read_parquet(DATA / STEP_TRACES_FILE)


@pytest.fixture(scope="module")
def requests() -> pd.DataFrame:
    return pd.read_parquet(DATA / STEP_REQUESTS_FILE)


@pytest.fixture(scope="module")
def metadata() -> dict:
    return json.loads((DATA / METADATA_FILE).read_text())


def _cycles(steps: pd.DataFrame) -> pd.DataFrame:
    """Cycle-time targets: ts_start[i+1] - ts_start[i] for consecutive sampled step ids."""
    s = steps.sort_values(["experiment_id", "step.id"], kind="stable")
    same = s["experiment_id"].to_numpy()[1:] == s["experiment_id"].to_numpy()[:-1]
    ok = same & (np.diff(s["step.id"].to_numpy()) == 1)
    out = s.iloc[:-1][ok].copy()
    out["cycle_us"] = np.diff(s["step.ts_start_ns"].to_numpy())[ok] / 1e3
    return out


# --- the shipped files -------------------------------------------------------------


def test_schema_matches_the_real_traces(steps, requests):
    assert list(steps.columns) == REAL_COLUMNS
    schema = pq.read_schema(DATA / STEP_TRACES_FILE)
    for name in REAL_COLUMNS:
        t = str(schema.field(name).type)
        if name in ("experiment_id", "model", "workload"):
            assert "string" in t
        elif name == "kv.usage_gpu_ratio":
            assert t == "double"
        else:
            assert t == "int64", name
    assert list(requests.columns) == list(REQUEST_COLUMNS)
    rschema = pq.read_schema(DATA / STEP_REQUESTS_FILE)
    for name in REQUEST_COLUMNS[1:]:
        assert str(rschema.field(name).type) == "int32"
    # 4 models x 4 workloads, with the trace data's model names
    assert steps["experiment_id"].nunique() == 16
    assert set(steps["model"]) == {"llama-2-7b", "llama-2-70b", "codellama-34b", "mixtral-8x7b-v0-1"}
    assert set(steps["workload"]) == {"general", "codegen", "roleplay", "reasoning"}
    assert "synthetic-llama-2-70b-tp4-general" in set(steps["experiment_id"])
    assert dict(steps.groupby("model")["tp"].first()) == {
        "llama-2-7b": 1,
        "llama-2-70b": 4,
        "codellama-34b": 2,
        "mixtral-8x7b-v0-1": 2,
    }


def test_schema_equals_the_shared_real_trace(shared_data, steps):
    real = pq.read_schema(shared_data / "steps" / "step_traces.parquet")
    assert real.names == list(steps.columns)
    ours = pq.read_schema(DATA / STEP_TRACES_FILE)
    for name in real.names:
        assert ours.field(name).type == real.field(name).type, name


def test_cycle_time_calibration(steps):
    cyc = _cycles(steps)
    mean = cyc.groupby("experiment_id")["cycle_us"].mean()
    assert mean["synthetic-llama-2-70b-tp4-general"] == pytest.approx(20_000, rel=0.15)
    assert mean["synthetic-codellama-34b-tp2-general"] == pytest.approx(15_700, rel=0.15)
    dec = steps.groupby("experiment_id")["batch.decode_tokens"].mean()
    assert dec["synthetic-llama-2-70b-tp4-general"] == pytest.approx(66, rel=0.25)
    assert dec["synthetic-codellama-34b-tp2-general"] == pytest.approx(53, rel=0.25)
    # enough consecutive pairs to learn from, in every experiment
    assert len(cyc) >= 5000
    assert cyc.groupby("experiment_id").size().min() >= 100
    assert (cyc["cycle_us"] > 0).all()


def test_request_detail_matches_the_aggregates(steps, requests):
    r = requests
    prefill = r["progress"] < r["input_len"]  # primitives.registry.IS_PREFILL
    agg = pd.DataFrame(
        {
            "rows": r.groupby(["experiment_id", "step.id"]).size(),
            "tokens": r.groupby(["experiment_id", "step.id"])["new_tokens"].sum(),
            "prefill_tokens": r["new_tokens"].where(prefill, 0).groupby([r["experiment_id"], r["step.id"]]).sum(),
            "n_prefill": prefill.groupby([r["experiment_id"], r["step.id"]]).sum(),
        }
    )
    s = steps.set_index(["experiment_id", "step.id"]).sort_index()
    agg = agg.reindex(s.index)
    assert not agg.isna().any().any(), "every sampled step has its per-request rows"
    assert len(agg) == len(s) and agg["rows"].sum() == len(r)
    np.testing.assert_array_equal(agg["tokens"], s["batch.scheduled_tokens"])
    np.testing.assert_array_equal(agg["prefill_tokens"], s["batch.prefill_tokens"])
    np.testing.assert_array_equal(agg["tokens"] - agg["prefill_tokens"], s["batch.decode_tokens"])
    np.testing.assert_array_equal(agg["n_prefill"], s["batch.num_prefill_reqs"])
    np.testing.assert_array_equal(agg["rows"] - agg["n_prefill"], s["batch.num_decode_reqs"])
    assert (r["new_tokens"] > 0).all() and (s["batch.scheduled_tokens"] <= DEFAULT_MAX_NUM_BATCHED_TOKENS).all()
    assert (s["queue.running_depth"] <= DEFAULT_MAX_NUM_SEQS).all()
    # a decode computes one token, except the recompute of a preempted request's output
    multi = ~prefill & (r["new_tokens"] > 1)
    preempting = set(steps.loc[steps["batch.num_preempted"] > 0, "experiment_id"])
    assert set(r.loc[multi, "experiment_id"]) <= preempting
    kv = r.loc[multi, "progress"] + r.loc[multi, "new_tokens"]
    assert (kv <= r.loc[multi, "input_len"] + r.loc[multi, "output_len"]).all()


def test_kv_columns_and_timestamps_are_consistent(steps):
    res = DeploymentResolver()
    for m in SERVED_MODELS:
        g = steps[steps["model"] == m.trace_name]
        blocks = res.resolve(m.trace_name, m.tp).kv_capacity_blocks()
        assert (g["kv.blocks_total_gpu"] == blocks).all()
    used = steps["kv.blocks_total_gpu"] - steps["kv.blocks_free_gpu"]
    assert (used >= 0).all()
    np.testing.assert_allclose(steps["kv.usage_gpu_ratio"], used / steps["kv.blocks_total_gpu"], rtol=1e-12)
    # ts_end - ts_start is the scheduler CPU time, small and inside the cycle
    dur = steps["step.duration_us"]
    assert (dur > 0).all()
    assert ((steps["step.ts_end_ns"] - steps["step.ts_start_ns"]) == dur * 1000).all()
    cyc = _cycles(steps)
    assert (cyc["step.duration_us"] < cyc["cycle_us"]).all()
    assert dur.median() < 5_000
    for _, g in steps.groupby("experiment_id"):
        g = g.sort_values("step.id")
        assert (np.diff(g["step.ts_start_ns"].to_numpy()) > 0).all()


def test_metadata_describes_the_files(steps, requests, metadata):
    assert metadata["generator_version"] == GENERATOR_VERSION
    assert metadata["seed"] == DEFAULT_SEED
    assert metadata["noise_sigma"] == EmulatorPhysics().noise_sigma
    assert metadata["files"][STEP_TRACES_FILE]["rows"] == len(steps)
    assert metadata["files"][STEP_REQUESTS_FILE]["rows"] == len(requests)
    assert metadata["files"][STEP_TRACES_FILE]["sha256_rows"] == frame_digest(steps)
    assert metadata["cycle_pairs"] == len(_cycles(steps))
    # the oracle's error is the lognormal floor (about 0.8 sigma) plus rare idle gaps
    floor = metadata["noise_floor_mape"]
    assert metadata["noise_floor_mape_expected"] == pytest.approx(expected_noise_floor_mape(0.03))
    assert 0.9 * metadata["noise_floor_mape_expected"] < floor < 1.3 * metadata["noise_floor_mape_expected"]
    size = sum((DATA / f).stat().st_size for f in (STEP_TRACES_FILE, STEP_REQUESTS_FILE))
    assert size < 6.5e6


def test_the_oracle_reproduces_the_noise_floor_from_the_files(steps, requests, metadata):
    """Noiseless physics from the shipped per-request rows vs the shipped cycle targets."""
    eid = "synthetic-llama-2-70b-tp4-general"
    s = steps[steps["experiment_id"] == eid].sort_values("step.id")
    r = requests[requests["experiment_id"] == eid]
    hp = HiddenPhysics(DeploymentResolver().resolve("llama-2-70b", 4))
    counts = r.groupby("step.id", sort=True).size().reindex(s["step.id"]).to_numpy()
    rr = r.sort_values("step.id", kind="stable")
    pred = hp.cycle_time_us_csr(
        np.r_[0, np.cumsum(counts)],
        rr["progress"].to_numpy(),
        rr["new_tokens"].to_numpy(),
        rr["input_len"].to_numpy(),
        rr["output_len"].to_numpy(),
    )
    ok = np.diff(s["step.id"].to_numpy()) == 1
    target = np.diff(s["step.ts_start_ns"].to_numpy())[ok] / 1e3
    mape = float(np.mean(np.abs(pred[:-1][ok] - target) / target))
    (summary,) = [e for e in metadata["experiments"] if e["experiment_id"] == eid]
    assert mape == pytest.approx(summary["oracle_mape"], rel=1e-6)
    assert mape < 0.04


# --- the hidden physics ---------------------------------------------------------------


def _dep(name="llama-2-70b", tp=4):
    return DeploymentResolver().resolve(name, tp)


def _decode_batch(n, ctx=700, input_len=575):
    progress = np.full(n, ctx - 1, dtype=np.int64)
    return progress, np.ones(n, dtype=np.int64), np.full(n, input_len, dtype=np.int64), progress - input_len + 1


def test_step_time_is_deterministic_for_a_seed():
    batches = [_decode_batch(n) for n in (1, 7, 40, 128)]
    runs = []
    for seed in (3, 3, 4):
        server = EmulatedVLLM(_dep(), seed=seed)
        runs.append([server.step_time_us(*b) for b in batches * 3])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    quiet = EmulatedVLLM(_dep(), EmulatorPhysics(noise_sigma=0.0), seed=3)
    noiseless = [quiet.step_time_us(*b) for b in batches]
    assert noiseless == [quiet.noiseless_step_time_us(*b) for b in batches]
    ratio = np.array(runs[0][:4]) / np.array(noiseless)
    assert np.all(np.abs(np.log(ratio)) < 5 * 0.03)


def test_generation_is_deterministic_for_a_seed():
    m = SERVED_MODELS[1]
    w = WORKLOADS["codegen"]
    a = generate_experiment(m, w, seed=5, index=4, duration_scale=0.02)
    b = generate_experiment(m, w, seed=5, index=4, duration_scale=0.02)
    pd.testing.assert_frame_equal(a.steps, b.steps)
    pd.testing.assert_frame_equal(a.requests, b.requests)
    c = generate_experiment(m, w, seed=6, index=4, duration_scale=0.02)
    assert not a.steps["step.ts_start_ns"].equals(c.steps["step.ts_start_ns"])


@pytest.mark.parametrize("index", [3, 14])  # Llama-2-7B reasoning (its KV cache fills), Mixtral roleplay (MoE)
def test_the_shipped_data_is_what_the_emulator_generates_now(index, steps, requests, metadata):
    """The embedded dataset is the emulator's output at the shipped seed: a change to the
    simulator or the emulator that alters it must regenerate the data (README,
    "Regenerating the embedded data"). Two experiments, regenerated alone (each has its
    own random streams), row for row."""
    model, workload = all_experiments()[index]
    name = experiment_id(model, workload)
    part = generate_experiment(model, workload, metadata["seed"], index, duration_scale=metadata["duration_scale"])
    # to 1e-12: a CPU whose numpy computes exp() to another last bit may move a timestamp
    # (~1e13 ns) by a nanosecond; any change of behaviour moves far more
    same = {"check_exact": False, "rtol": 1e-12, "atol": 0.0}
    regenerate = f"stale embedded data ({name}): run {metadata['command'].replace('<dir>', str(DATA))}"
    for got, shipped in ((part.steps, steps), (part.requests, requests)):
        try:
            pd.testing.assert_frame_equal(got, shipped[shipped["experiment_id"] == name].reset_index(drop=True), **same)
        except AssertionError as exc:
            raise AssertionError(f"{regenerate}\n{exc}") from None


def test_decode_calibration_points():
    """Noiseless decode-only cycles near the published per-token times (±10 %)."""
    points = {  # model, tp, running, context, measured ms
        ("llama-2-7b", 1): [(9, 690, 7.2), (83, 700, 16.5)],
        ("llama-2-70b", 4): [(37, 700, 18.6), (66, 700, 20.0), (110, 700, 22.0)],
        ("codellama-34b", 2): [(30, 700, 14.8), (53, 700, 15.7), (85, 700, 17.0)],
        ("mixtral-8x7b-v0-1", 2): [(38, 700, 19.2), (103, 700, 20.5)],
    }
    for (name, tp), pts in points.items():
        hp = HiddenPhysics(_dep(name, tp))
        for n, ctx, ms in pts:
            assert hp.cycle_time_us(*_decode_batch(n, ctx)) / 1e3 == pytest.approx(ms, rel=0.10), (name, n)


def test_physics_structure():
    hp = HiddenPhysics(_dep())
    t = [hp.cycle_time_us(*_decode_batch(n)) for n in (1, 16, 64, 128)]
    assert np.all(np.diff(t) > 0)
    assert hp.cycle_time_us(*_decode_batch(32, ctx=2000)) > hp.cycle_time_us(*_decode_batch(32, ctx=500))
    # a 2048-token prefill chunk is compute bound: several decode steps long
    prefill = hp.cycle_time_us(np.zeros(1, np.int64), np.array([2048]), np.array([3000]), np.zeros(1, np.int64))
    assert prefill > 4 * t[0]
    # MoE: one token streams only its top-2 experts; a big batch streams all 8
    moe = HiddenPhysics(_dep("mixtral-8x7b-v0-1", 2))
    small, big = moe.cycle_time_us(*_decode_batch(1)), moe.cycle_time_us(*_decode_batch(64))
    a = moe.arch
    expert_ms = a.n_layers * a.expert_params_per_gpu * a.dtype_bytes / (a.hbm_bytes_per_us * 0.9) / 1e3
    assert (big - small) / 1e3 > 5.0 * expert_ms
    # vectorised CSR evaluation equals one-by-one evaluation
    batches = [_decode_batch(n) for n in (3, 5)]
    cols = [np.concatenate([b[i] for b in batches]) for i in range(4)]
    csr = hp.cycle_time_us_csr(np.array([0, 3, 8]), *cols)
    np.testing.assert_allclose(csr, [hp.cycle_time_us(*b) for b in batches])


def test_expected_noise_floor_matches_monte_carlo():
    z = np.random.default_rng(0).standard_normal(400_000)
    mc = np.mean(np.abs(1.0 - np.exp(-0.03 * z)))
    assert expected_noise_floor_mape(0.03) == pytest.approx(mc, rel=0.01)


def test_workloads_mirror_the_real_inputs():
    w = WORKLOADS
    general = w["general"]
    assert (general.question_len, general.output_len, general.stages) == (447, 248, ((8.0, 600.0), (20.0, 600.0)))
    assert w["reasoning"].stages == ((4.0, 1200.0),) and w["reasoning"].output_len == 1448
    assert w["roleplay"].system_prompt_len == 150
    spec = experiment_spec(SERVED_MODELS[0], w["general"])
    assert spec.stages == ((8.0, 300.0), (20.0, 300.0))  # scaled by DURATION_SCALE
    assert spec.num_groups == 10 and spec.num_prompts_per_group == 10


def test_cli_rejects_bad_options(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--duration-scale", "2"]) == 2
    assert "duration-scale" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--experiments", "no-such-model"]) == 2
    assert "no experiment matches" in capsys.readouterr().err
