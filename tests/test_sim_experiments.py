"""Experiment-directory loaders: the real runs (when shared data is present) and malformed input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from primitives.data.experiments import find_experiments, load_experiment
from primitives.data.roots import shared_data_root
from primitives.errors import InputError


def _experiments_dir() -> Path:
    return shared_data_root() / "data" / "experiments"


@pytest.fixture(scope="module")
def real_specs():
    d = _experiments_dir()
    if not d.is_dir():
        pytest.skip(f"shared experiments not found at {d} (set STEPSYNTH_SHARED to the shared/ folder)")
    return find_experiments(d)


def test_real_experiments_load(real_specs):
    assert len(real_specs) == 16
    assert [s.name for s in real_specs] == sorted(s.name for s in real_specs)
    with_results = [s for s in real_specs if s.observed is not None]
    assert len(with_results) == 12
    assert all(s.workload == "reasoning" for s in real_specs if s.observed is None)
    for s in real_specs:
        assert s.max_num_batched_tokens == 2048 and s.max_num_seqs == 128 and s.max_model_len == 4096
        assert s.gpu_memory_utilization == 0.9
        assert s.request_timeout_s == 300.0  # request_timeout: null -> aiohttp's default
        # results/config.yaml wins over profile.yaml (which says 9 x 5 for general)
        assert (s.num_groups, s.num_prompts_per_group) == (10, 10)
        if s.observed is not None:
            assert len(s.observed.stages) == len(s.stages)
            assert s.observed.summary.successes == s.num_requests


def test_real_llama70b_general(real_specs):
    spec = next(s for s in real_specs if s.name.endswith("llama-2-70b-tp4-general"))
    assert spec.model == "meta-llama/Llama-2-70b-hf" and spec.tp == 4
    assert spec.stages == ((8.0, 600.0), (20.0, 600.0))
    assert (spec.system_prompt_len, spec.question_len, spec.output_len) == (100, 447, 248)
    assert spec.num_requests == 16800
    obs = spec.observed
    assert obs.summary.successes == 16800 and obs.summary.failures == 0
    assert obs.summary.e2e_mean_s == pytest.approx(5.3206, abs=1e-4)
    assert obs.summary.ttft_mean_s == pytest.approx(0.10302, abs=1e-5)
    assert obs.stages[0].successes == 4800 and obs.stages[1].successes == 12000
    # ITL and TPOT are half the per-token time (two events per token)
    per_token = (obs.summary.e2e_mean_s - obs.summary.ttft_mean_s) / spec.output_len
    assert obs.summary.itl_mean_s == pytest.approx(per_token / 2, rel=0.01)
    # the percentiles, the files' "median" as p50
    assert obs.summary.stat_s("e2e", "p99") == pytest.approx(6.63237, abs=1e-5)
    assert obs.summary.stat_s("itl", "p50") == pytest.approx(3.8301e-5, rel=1e-4)  # the gap between a token's events
    assert obs.stages[1].stat_s("ttft", "p90") == pytest.approx(0.250062, abs=1e-6)
    assert list(obs.summary.distributions) == ["e2e", "ttft", "itl", "tpot"]
    assert list(obs.summary.distributions["tpot"])[:2] == ["p0.1", "p1"]


# ---------------------------------------------------------------------------
# Malformed input, on a hand-made directory

EXP = """model: meta-llama/Llama-2-7b-hf
tensor_parallelism: 1
max_model_len: 4096
max_num_batched_tokens: 2048
max_num_seqs: 128
"""
PROFILE = {
    "data": {
        "shared_prefix": {
            "num_unique_system_prompts": 3,
            "num_users_per_system_prompt": 2,
            "system_prompt_len": 100,
            "question_len": 400,
            "output_len": 200,
        }
    },
    "load": {"stages": [{"rate": 2, "duration": 10}], "type": "constant"},
}
RESULTS_CONFIG = """data:
  shared_prefix:
    num_groups: 4
    num_prompts_per_group: 5
    system_prompt_len: 100
    question_len: 400
    output_len: 200
load:
  type: constant
  interval: 1.0
  stages:
  - rate: 3.0
    duration: 20
  request_timeout: null
"""


def _summary(successes=60, failures=0, e2e=2.0):
    lat = {
        "request_latency": {"mean": e2e},
        "time_to_first_token": {"mean": 0.03},
        "inter_token_latency": {"mean": 0.004},
        "time_per_output_token": {"mean": 0.004},
    }
    return {"successes": {"count": successes, "latency": lat}, "failures": {"count": failures}}


def _make(tmp_path: Path, results_config: bool = True, metrics: bool = True) -> Path:
    d = tmp_path / "20260101-000000-llama-2-7b-tp1-general"
    (d / "results").mkdir(parents=True)
    (d / "exp-config.yaml").write_text(EXP)
    (d / "profile.yaml").write_text(json.dumps(PROFILE))
    if results_config:
        (d / "results" / "config.yaml").write_text(RESULTS_CONFIG)
    if metrics:
        (d / "results" / "summary_lifecycle_metrics.json").write_text(json.dumps(_summary()))
        (d / "results" / "stage_0_lifecycle_metrics.json").write_text(json.dumps(_summary()))
    return d


def test_results_config_wins_and_profile_fallback(tmp_path):
    d = _make(tmp_path)
    spec = load_experiment(d)
    assert (spec.num_groups, spec.num_prompts_per_group) == (4, 5)
    assert spec.stages == ((3.0, 20.0),) and spec.request_timeout_s == 300.0
    assert spec.observed.summary.e2e_mean_s == 2.0 and len(spec.observed.stages) == 1
    (d / "results" / "config.yaml").unlink()
    spec = load_experiment(d)
    assert (spec.num_groups, spec.num_prompts_per_group) == (3, 2)
    assert spec.stages == ((2.0, 10.0),)


def test_no_metrics_means_blind(tmp_path):
    spec = load_experiment(_make(tmp_path, metrics=False))
    assert spec.observed is None


def test_find_experiments_sorted(tmp_path):
    for name in ("b", "a"):
        sub = tmp_path / name
        _make(sub).rename(tmp_path / f"{name}-run")
    specs = find_experiments(tmp_path)
    assert [s.name for s in specs] == ["a-run", "b-run"]


def test_find_experiments_at_any_depth(tmp_path):
    # exps/h100/<run>/ and exps/<run>/ together, sorted by name; hidden folders skipped
    _make(tmp_path / "h100" / "x").rename(tmp_path / "h100" / "b-run")
    _make(tmp_path / "y").rename(tmp_path / "a-run")
    _make(tmp_path / ".trash" / "z").rename(tmp_path / ".trash" / "c-run")
    (tmp_path / "h100" / "loop").symlink_to(tmp_path)  # searched once, not forever
    specs = find_experiments(tmp_path)
    assert [s.name for s in specs] == ["a-run", "b-run"]
    assert Path(specs[1].path).parent.name == "h100"


def test_find_experiments_refuses_one_folder_under_two_names(tmp_path):
    d = _make(tmp_path / "real")
    (tmp_path / "a").symlink_to(d)
    (tmp_path / "b").symlink_to(d)
    with pytest.raises(InputError, match="the same experiment folder as"):
        find_experiments(tmp_path)


def test_a_folder_with_a_results_folder_of_its_own_is_not_a_broken_experiment(tmp_path):
    _make(tmp_path / "x").rename(tmp_path / "a-run")
    (tmp_path / "notes" / "sub" / "results").mkdir(parents=True)  # not an experiment's results
    assert [s.name for s in find_experiments(tmp_path)] == ["a-run"]
    (tmp_path / "notes" / "sub" / "results" / "summary_lifecycle_metrics.json").write_text("{}")
    with pytest.raises(InputError, match="beside the experiment's other files"):
        find_experiments(tmp_path)


def test_find_experiments_refuses_two_of_one_name(tmp_path):
    _make(tmp_path / "h100" / "x").rename(tmp_path / "h100" / "run")
    _make(tmp_path / "a100" / "x").rename(tmp_path / "a100" / "run")
    with pytest.raises(InputError, match="two experiments named 'run'"):
        find_experiments(tmp_path)


def _expect(exc_info, path_part: str, field_part: str | None):
    err = exc_info.value
    assert path_part in err.path
    if field_part is None:
        assert err.field is None
    else:
        assert err.field is not None and field_part in err.field
    assert err.expected


def test_missing_exp_config(tmp_path):
    d = _make(tmp_path)
    (d / "exp-config.yaml").unlink()
    with pytest.raises(InputError) as e:
        load_experiment(d)
    _expect(e, "exp-config.yaml", None)


def test_empty_file(tmp_path):
    d = _make(tmp_path)
    (d / "exp-config.yaml").write_text("  \n")
    with pytest.raises(InputError) as e:
        load_experiment(d)
    _expect(e, "exp-config.yaml", None)
    assert "empty" in e.value.expected


def test_missing_field(tmp_path):
    d = _make(tmp_path)
    (d / "exp-config.yaml").write_text(EXP.replace("tensor_parallelism: 1\n", ""))
    with pytest.raises(InputError) as e:
        load_experiment(d)
    _expect(e, "exp-config.yaml", "tensor_parallelism")


def test_non_numeric_field(tmp_path):
    d = _make(tmp_path)
    (d / "results" / "config.yaml").write_text(RESULTS_CONFIG.replace("question_len: 400", "question_len: lots"))
    with pytest.raises(InputError) as e:
        load_experiment(d)
    _expect(e, "config.yaml", "data.shared_prefix.question_len")
    assert "number" in e.value.expected


def test_bad_stage(tmp_path):
    d = _make(tmp_path)
    (d / "results" / "config.yaml").write_text(RESULTS_CONFIG.replace("duration: 20", "duration: -5"))
    with pytest.raises(InputError) as e:
        load_experiment(d)
    _expect(e, "config.yaml", "load.stages[0].duration")


def test_bad_profile_json(tmp_path):
    d = _make(tmp_path, results_config=False)
    (d / "profile.yaml").write_text("{not json")
    with pytest.raises(InputError) as e:
        load_experiment(d)
    _expect(e, "profile.yaml", None)


def test_data_the_simulator_does_not_generate_is_refused(tmp_path):
    d = _make(tmp_path, results_config=False)
    (d / "profile.yaml").write_text(json.dumps({**PROFILE, "data": {**PROFILE["data"], "type": "mystery"}}))
    with pytest.raises(InputError) as e:
        load_experiment(d)
    _expect(e, "profile.yaml", "data.type")
    d = _make(tmp_path / "b")
    (d / "results" / "config.yaml").write_text(RESULTS_CONFIG.replace("data:", "data:\n  type: random", 1))
    with pytest.raises(InputError) as e:
        load_experiment(d)
    _expect(e, "config.yaml", "data.type")


def test_bad_metrics(tmp_path):
    d = _make(tmp_path)
    bad = _summary()
    bad["successes"]["latency"]["request_latency"]["mean"] = "slow"
    (d / "results" / "summary_lifecycle_metrics.json").write_text(json.dumps(bad))
    with pytest.raises(InputError) as e:
        load_experiment(d)
    _expect(e, "summary_lifecycle_metrics.json", "successes.latency.request_latency.mean")
    (d / "results" / "summary_lifecycle_metrics.json").write_text(json.dumps({"successes": {"count": 3}}))
    with pytest.raises(InputError) as e:
        load_experiment(d)
    _expect(e, "summary_lifecycle_metrics.json", "failures.count")


def test_percentiles_are_read_where_present(tmp_path):
    d = _make(tmp_path)
    summary = _summary()
    summary["successes"]["latency"]["request_latency"].update({"median": 1.9, "p90": 2.5, "p99.9": 4.0})
    (d / "results" / "summary_lifecycle_metrics.json").write_text(json.dumps(summary))
    obs = load_experiment(d).observed
    assert obs.summary.distributions == {"e2e": {"p50": 1.9, "p90": 2.5, "p99.9": 4.0}}
    assert obs.summary.stat_s("e2e", "p90") == 2.5 and obs.summary.stat_s("ttft", "p90") is None
    assert obs.stages[0].distributions == {}  # means only: no percentiles, no error
    summary["successes"]["latency"]["request_latency"]["p99"] = "late"
    (d / "results" / "summary_lifecycle_metrics.json").write_text(json.dumps(summary))
    with pytest.raises(InputError) as e:
        load_experiment(d)
    _expect(e, "summary_lifecycle_metrics.json", "successes.latency.request_latency.p99")


def test_zero_successes_allows_null_latency(tmp_path):
    d = _make(tmp_path)
    s = {"successes": {"count": 0, "latency": None}, "failures": {"count": 60}}
    (d / "results" / "summary_lifecycle_metrics.json").write_text(json.dumps(s))
    spec = load_experiment(d)
    assert spec.observed.summary.successes == 0 and spec.observed.summary.e2e_mean_s is None


def test_not_a_directory(tmp_path):
    with pytest.raises(InputError):
        load_experiment(tmp_path / "nope")
    with pytest.raises(InputError):
        find_experiments(tmp_path)  # empty: no experiment below
