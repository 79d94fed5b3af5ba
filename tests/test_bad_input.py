"""Malformed input: ONE line on stderr naming the file, the field and what was expected;
exit status 2; never a traceback (the unwritable outputs: ``test_bad_output.py``).

Most cases call ``evolve.cli.main`` in-process (an uncaught exception would fail the
test just like a traceback would reach a user); a few run ``python -m evolve`` for real.
The ``archive`` and ``read_only_dir`` fixtures are in ``conftest.py``.
"""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from error_lines import assert_one_line_error, call, good_trace, run_args, set_cell


# --- step traces (the loader behind run --data and score --data) -------------------
def _drop(col):
    return lambda df: df.drop(columns=[col])


def _rename(col, new):
    return lambda df: df.rename(columns={col: new})


def _dup_id(df):
    df = df.copy()
    df.loc[5, "step.id"] = 4
    return df


def _zero_cycle(df):
    return set_cell(df, 6, "step.ts_start_ns", df.loc[5, "step.ts_start_ns"])


def _negative_cycle(df):
    return set_cell(df, 6, "step.ts_start_ns", df.loc[5, "step.ts_start_ns"] - 1000)


def _no_consecutive(df):
    df = df.copy()
    df["step.id"] = np.arange(len(df)) * 2  # every other step sampled: no cycle time anywhere
    return df


TRACE_CASES = {
    # case: (mutation, needles the one line must contain)
    "missing_column": (_drop("batch.decode_tokens"), ["batch.decode_tokens", "missing column", "expected"]),
    "misnamed_column": (_rename("kv.blocks_free_gpu", "kv.free_blocks"), ["kv.blocks_free_gpu", "missing column"]),
    "missing_timestamp_column": (_drop("step.ts_start_ns"), ["step.ts_start_ns", "missing column"]),
    "non_numeric": (
        lambda df: set_cell(df, 3, "batch.decode_tokens", "abc"),
        ["batch.decode_tokens", "non-numeric", "'abc'"],
    ),
    "non_numeric_tp": (lambda df: set_cell(df, 0, "tp", "four"), ["tp", "non-numeric"]),
    "nan": (lambda df: set_cell(df, 4, "batch.prefill_tokens", np.nan), ["batch.prefill_tokens", "NaN", "row 4"]),
    "infinite": (lambda df: set_cell(df, 7, "step.ts_start_ns", np.inf), ["step.ts_start_ns", "non-finite"]),
    "negative_count": (lambda df: set_cell(df, 7, "batch.decode_tokens", -1), ["batch.decode_tokens", "negative"]),
    "fractional_count": (
        lambda df: set_cell(df, 3, "batch.decode_tokens", 2.5),
        ["batch.decode_tokens", "non-integer value 2.5 in row 3"],
    ),
    "zero_duration": (lambda df: set_cell(df, 5, "step.duration_us", 0), ["step.duration_us", "non-positive"]),
    "negative_duration": (lambda df: set_cell(df, 5, "step.duration_us", -3), ["step.duration_us", "negative"]),
    "zero_cycle": (_zero_cycle, ["step.ts_start_ns", "row 6", "monotonic"]),
    "negative_cycle": (_negative_cycle, ["step.ts_start_ns", "row 6", "monotonic"]),
    "non_monotonic": (lambda df: set_cell(df, 10, "step.ts_start_ns", 0), ["step.ts_start_ns", "monotonic"]),
    "duplicate_step_id": (_dup_id, ["step.id", "duplicate"]),
    "fractional_step_id": (lambda df: set_cell(df, 0, "step.id", 0.5), ["step.id", "non-integer", "integer step id"]),
    "zero_tp": (lambda df: df.assign(tp=0), ["tp", ">= 1"]),
    "missing_experiment": (lambda df: set_cell(df, 3, "experiment_id", np.nan), ["experiment_id", "row 3"]),
    "more_free_than_total": (
        lambda df: set_cell(df, 2, "kv.blocks_free_gpu", 9000),
        ["kv.blocks_free_gpu", "kv.blocks_total_gpu"],
    ),
    "no_consecutive_steps": (_no_consecutive, ["step.id", "'tiny'", "consecutive"]),
    "header_only": (lambda df: df.iloc[:0], ["no rows"]),
}


@pytest.mark.parametrize("case", sorted(TRACE_CASES))
def test_bad_csv_trace(case, work, capsys):
    mutate, needles = TRACE_CASES[case]
    mutate(good_trace()).to_csv(work / "bad.csv", index=False)
    rc, _, err = call(run_args("bad.csv"), capsys)
    assert_one_line_error(rc, err, "bad.csv", *needles)


@pytest.mark.parametrize("case", ["nan", "header_only", "zero_cycle"])
def test_bad_parquet_trace(case, work, capsys):
    mutate, needles = TRACE_CASES[case]
    df = mutate(good_trace())
    if case == "nan":
        df = df.astype({"batch.prefill_tokens": float})
    df.to_parquet(work / "bad.parquet")
    rc, _, err = call(run_args("bad.parquet"), capsys)
    assert_one_line_error(rc, err, "bad.parquet", *needles)


@pytest.mark.parametrize(
    "name,content,needle",
    [
        ("empty.csv", "", "empty"),
        ("empty.parquet", "", "empty"),
        ("blank.csv", "\n\n", "not a readable csv"),
        ("garbage.csv", 'a,b\n1,2,3,4\n"unterminated\n', "not a readable csv"),
        ("garbage.parquet", "not parquet", "not a readable parquet"),
        ("trace.txt", "x", "expected a .parquet or .csv file, or a folder holding one"),
    ],
)
def test_unreadable_or_empty_trace_file(name, content, needle, work, capsys):
    (work / name).write_text(content)
    rc, _, err = call(run_args(name), capsys)
    assert_one_line_error(rc, err, name, needle)


def test_missing_trace_file(work, capsys):
    rc, _, err = call(run_args("nowhere.csv"), capsys)
    assert_one_line_error(rc, err, "nowhere.csv", "--data", "no such file")


def test_directory_without_a_trace(work, capsys):
    (work / "folder").mkdir()
    rc, _, err = call(run_args("folder"), capsys)
    assert_one_line_error(rc, err, "folder", "step_traces.parquet")


def test_per_request_detail_missing_column(work, capsys):
    d = work / "trace"
    d.mkdir()
    good_trace().to_csv(d / "step_traces.csv", index=False)
    pd.DataFrame(
        {"experiment_id": ["tiny"], "step.id": [0], "new_tokens": [1], "input_len": [5], "output_len": [1]}
    ).to_csv(d / "step_requests.csv", index=False)
    rc, _, err = call(run_args("trace"), capsys)
    assert_one_line_error(rc, err, "step_requests.csv", "progress", "missing column")


def test_unknown_model_in_a_trace_is_one_line_naming_the_trace_file(work, capsys):
    good_trace().assign(model="gpt-17").to_csv(work / "bad.csv", index=False)
    rc, _, err = call(run_args("bad.csv"), capsys)
    assert_one_line_error(rc, err, "bad.csv", "gpt-17", "model", "known models")


def test_score_reads_traces_through_the_same_checks(archive, work, capsys):
    run_dir, entry_id, _ = archive
    set_cell(good_trace(), 4, "batch.decode_tokens", np.nan).to_csv(work / "bad.csv", index=False)
    rc, _, err = call(["score", entry_id, "--data", "bad.csv", "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, "bad.csv", "batch.decode_tokens", "NaN")


# --- model configs and GPU datasheets ------------------------------------------------
LLAMA_7B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "torch_dtype": "float16",
}
H100 = {
    "name": "H100 SXM",
    "compute": {"bf16_tensor_core": 1979, "fp16_tensor_core": 1979, "with_sparsity": True},
    "memory": {"capacity_gb": 80, "bandwidth_tb_s": 3.35},
    "interconnect": {"nvlink_bandwidth_gb_s": 900},
}


def _model_configs(work: Path, cfg: dict | str) -> Path:
    d = work / "configs" / "Llama-2-7b-hf"
    d.mkdir(parents=True)
    (d / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return work / "configs"


@pytest.mark.parametrize(
    "case,cfg,needles",
    [
        (
            "unknown_architecture",
            {**LLAMA_7B, "architectures": ["GPTBigCodeForCausalLM"]},
            ["architectures", "unknown architecture 'GPTBigCodeForCausalLM'", "LlamaForCausalLM"],
        ),
        ("no_architecture", {k: v for k, v in LLAMA_7B.items() if k != "architectures"}, ["architectures"]),
        ("missing_hidden_size", {k: v for k, v in LLAMA_7B.items() if k != "hidden_size"}, ["hidden_size", "missing"]),
        ("string_layers", {**LLAMA_7B, "num_hidden_layers": "thirty-two"}, ["num_hidden_layers", "expected a number"]),
        ("unknown_dtype", {**LLAMA_7B, "torch_dtype": "int3"}, ["torch_dtype", "int3"]),
        ("empty_file", "", ["empty"]),
        ("invalid_json", "{nope", ["not valid JSON"]),
        (
            "moe_without_experts",
            {**LLAMA_7B, "architectures": ["MixtralForCausalLM"]},
            ["num_local_experts", "missing"],
        ),
        ("huge_integer", json.dumps(LLAMA_7B).replace("4096", "1" + "0" * 400, 1), ["hidden_size", "401 digits"]),
        ("duplicate_key", json.dumps(LLAMA_7B)[:-1] + ', "num_hidden_layers": 40}', ["num_hidden_layers", "twice"]),
        ("nested_too_deeply", "[" * 100_000 + "]" * 100_000, ["nested too deeply"]),
        ("integer_too_long_to_read", json.dumps(LLAMA_7B).replace("4096", "1" * 5000, 1), ["not valid JSON"]),
    ],
)
def test_bad_model_config(case, cfg, needles, work, capsys):
    configs = _model_configs(work, cfg)
    rc, _, err = call(run_args("good.csv", "--model-configs", configs), capsys)
    assert_one_line_error(rc, err, "config.json", *needles)


def test_model_configs_without_any_config(work, capsys):
    (work / "configs").mkdir()
    rc, _, err = call(run_args("good.csv", "--model-configs", "configs"), capsys)
    assert_one_line_error(rc, err, "configs", "config.json")


def test_model_configs_not_a_directory(work, capsys):
    rc, _, err = call(run_args("good.csv", "--model-configs", "nowhere"), capsys)
    assert_one_line_error(rc, err, "nowhere", "--model-configs")


def _without(d: dict, section: str, key: str) -> dict:
    out = json.loads(json.dumps(d))
    del out[section][key]
    return out


@pytest.mark.parametrize(
    "case,sheet,needles",
    [
        ("missing_bandwidth", _without(H100, "memory", "bandwidth_tb_s"), ["memory.bandwidth_tb_s", "missing"]),
        ("missing_capacity", _without(H100, "memory", "capacity_gb"), ["memory.capacity_gb", "missing"]),
        (
            "missing_nvlink",
            _without(H100, "interconnect", "nvlink_bandwidth_gb_s"),
            ["interconnect.nvlink_bandwidth_gb_s"],
        ),
        ("missing_flops", {**H100, "compute": {"with_sparsity": True}}, ["compute.", "tensor_core", "missing"]),
        ("missing_section", {k: v for k, v in H100.items() if k != "memory"}, ["memory.", "missing"]),
        (
            "negative_bandwidth",
            {**H100, "memory": {"capacity_gb": 80, "bandwidth_tb_s": -1}},
            ["bandwidth_tb_s", "positive"],
        ),
        (
            "text_bandwidth",
            {**H100, "memory": {"capacity_gb": 80, "bandwidth_tb_s": "fast"}},
            ["bandwidth_tb_s", "'fast'"],
        ),
        ("empty_file", "", ["empty"]),
        ("not_an_object", "[1, 2]", ["JSON object"]),
    ],
)
def test_bad_gpu_datasheet(case, sheet, needles, work, capsys):
    path = work / "gpu.json"
    path.write_text(sheet if isinstance(sheet, str) else json.dumps(sheet))
    rc, _, err = call(run_args("good.csv", "--gpu-datasheet", "gpu.json"), capsys)
    assert_one_line_error(rc, err, "gpu.json", *needles)


def test_missing_gpu_datasheet(work, capsys):
    rc, _, err = call(run_args("good.csv", "--gpu-datasheet", "nowhere.json"), capsys)
    assert_one_line_error(rc, err, "nowhere.json", "--gpu-datasheet", "no such file")


# --- experiment directories ----------------------------------------------------------
EXP_CONFIG = (
    "model: meta-llama/Llama-2-7b-hf\ntensor_parallelism: 1\nmax_model_len: 4096\n"
    "max_num_batched_tokens: 2048\nmax_num_seqs: 128\n"
)
RESULTS_CONFIG = """data:
  type: shared_prefix
  shared_prefix: {num_groups: 2, num_prompts_per_group: 2, system_prompt_len: 100, question_len: 50, output_len: 20}
load:
  type: constant
  stages:
  - {rate: 1.0, duration: 5}
"""


def _metrics(e2e=1.0) -> dict:
    lat = {
        "request_latency": {"mean": e2e},
        "time_to_first_token": {"mean": 0.1},
        "inter_token_latency": {"mean": 0.01},
        "time_per_output_token": {"mean": 0.02},
    }
    return {"successes": {"count": 5, "latency": lat}, "failures": {"count": 0}}


def _experiment(
    root: Path,
    name: str = "20260101-000000-llama-2-7b-tp1-general",
    summary: dict | str | None = "ok",
    stages: int = 1,
    exp_config: str = EXP_CONFIG,
    results_config: str = RESULTS_CONFIG,
) -> Path:
    d = root / name
    (d / "results").mkdir(parents=True)
    (d / "exp-config.yaml").write_text(exp_config)
    (d / "results" / "config.yaml").write_text(results_config)
    for i in range(stages):
        (d / "results" / f"stage_{i}_lifecycle_metrics.json").write_text(json.dumps(_metrics()))
    if summary is not None:
        text = (
            json.dumps(_metrics()) if summary == "ok" else summary if isinstance(summary, str) else json.dumps(summary)
        )
        (d / "results" / "summary_lifecycle_metrics.json").write_text(text)
    return d


def test_run_with_an_experiments_dir_holding_no_experiment(work, capsys):
    (work / "exps" / "not-an-experiment").mkdir(parents=True)
    rc, _, err = call(run_args("good.csv", "--experiments", "exps"), capsys)
    assert_one_line_error(rc, err, "exps", "exp-config.yaml")


def test_an_experiment_folder_without_its_exp_config_is_named_not_skipped(archive, work, capsys):
    run_dir, entry_id, _ = archive
    _experiment(work / "exps")
    broken = _experiment(work / "exps", name="20260101-000001-llama-2-7b-tp1-codegen")
    (broken / "exp-config.yaml").unlink()
    rc, _, err = call(["validate", entry_id, "--experiments", "exps", "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, "000001-llama-2-7b-tp1-codegen/exp-config.yaml", "file not found", "beside")


def test_run_with_experiments_that_have_no_results(work, capsys):
    _experiment(work / "exps", summary=None, stages=0)  # a blind run: nothing to fit against
    rc, _, err = call(run_args("good.csv", "--experiments", "exps"), capsys)
    assert_one_line_error(rc, err, "exps", "results", "lifecycle metrics")


def test_validate_an_experiments_dir_holding_no_experiment(archive, work, capsys):
    run_dir, entry_id, _ = archive
    (work / "exps").mkdir()
    rc, _, err = call(["validate", entry_id, "--experiments", "exps", "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, "exps", "exp-config.yaml")


def test_validate_lomo_on_experiments_without_results(archive, work, capsys):
    run_dir, entry_id, _ = archive
    _experiment(work / "exps", summary=None, stages=0)
    rc, _, err = call(["validate", entry_id, "--lomo", "--experiments", "exps", "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, "exps", "results")


@pytest.mark.parametrize("mode, kind", [("--lomo", "models"), ("--lowo", "workloads")])
def test_validate_leave_one_out_of_a_single_group_says_so(mode, kind, archive, work, capsys):
    run_dir, entry_id, _ = archive
    _experiment(work / "exps")
    rc, _, err = call(["validate", entry_id, mode, "--experiments", "exps", "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, mode, f"two {kind} or more", "found one")


def test_validate_experiment_whose_stage_files_do_not_match_its_load_stages(archive, work, capsys):
    run_dir, entry_id, _ = archive
    _experiment(work / "exps", stages=2)  # RESULTS_CONFIG has one load stage
    rc, _, err = call(["validate", entry_id, "--experiments", "exps", "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, "results", "2 stage files for the 1 load stages", "one per stage")


def test_validate_experiment_whose_results_are_a_file(archive, work, capsys):
    import shutil

    run_dir, entry_id, _ = archive
    d = _experiment(work / "exps")
    shutil.rmtree(d / "results")
    # the load generator's input (one line of JSON), read where results/ is missing
    (d / "profile.yaml").write_text(json.dumps(yaml.safe_load(RESULTS_CONFIG)))
    (d / "results").write_text("withheld?")
    rc, _, err = call(["validate", entry_id, "--experiments", "exps", "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, "results", "is a file", "expected the folder")


def test_validate_experiment_with_stage_metrics_but_no_summary(archive, work, capsys):
    run_dir, entry_id, _ = archive
    _experiment(work / "exps", summary=None, stages=2)
    rc, _, err = call(["validate", entry_id, "--experiments", "exps", "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, "summary_lifecycle_metrics.json", "stage_0_lifecycle_metrics.json")


@pytest.mark.parametrize(
    "case,summary,needles",
    [
        ("empty_summary", "", ["empty"]),
        ("invalid_json", "{", ["not valid JSON"]),
        (
            "missing_latency",
            {"successes": {"count": 5, "latency": {}}, "failures": {"count": 0}},
            ["successes.latency.request_latency.mean", "missing"],
        ),
        ("text_count", {**_metrics(), "failures": {"count": "none"}}, ["failures.count", "expected a number"]),
    ],
)
def test_validate_experiment_with_bad_results(case, summary, needles, archive, work, capsys):
    run_dir, entry_id, _ = archive
    _experiment(work / "exps", summary=summary)
    rc, _, err = call(["validate", entry_id, "--experiments", "exps", "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, "summary_lifecycle_metrics.json", *needles)


def test_validate_experiment_with_bad_exp_config(archive, work, capsys):
    run_dir, entry_id, _ = archive
    _experiment(work / "exps", exp_config=EXP_CONFIG.replace("tensor_parallelism: 1\n", ""))
    rc, _, err = call(["validate", entry_id, "--experiments", "exps", "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, "exp-config.yaml", "tensor_parallelism", "missing")


def test_validate_experiment_with_a_load_the_simulator_does_not_reproduce(archive, work, capsys):
    run_dir, entry_id, _ = archive
    _experiment(work / "exps", results_config=RESULTS_CONFIG.replace("type: constant", "type: poisson"))
    rc, _, err = call(["validate", entry_id, "--experiments", "exps", "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, "config.yaml", "load.type", "expected constant", "'poisson'")


def test_validate_experiment_with_a_list_as_a_key(archive, work, capsys):
    run_dir, entry_id, _ = archive
    _experiment(work / "exps", exp_config=EXP_CONFIG + "? [a, b]\n: 1\n")
    rc, _, err = call(["validate", entry_id, "--experiments", "exps", "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, "exp-config.yaml", "not valid YAML")


def test_validate_experiment_with_a_key_given_twice(archive, work, capsys):
    run_dir, entry_id, _ = archive
    _experiment(work / "exps", exp_config=EXP_CONFIG + "tensor_parallelism: 2\n")
    rc, _, err = call(["validate", entry_id, "--experiments", "exps", "--run-dir", run_dir], capsys)
    assert_one_line_error(rc, err, "exp-config.yaml", "tensor_parallelism", "given twice")


# --- archive ids ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "command",
    [
        ["archive", "show", "deadbeef"],
        ["export-go", "deadbeef", "--out", "go-out"],
        ["score", "deadbeef", "--data", "DATA"],
        ["validate", "deadbeef", "--experiments", "EXPS"],
    ],
)
def test_unknown_archive_id(command, archive, work, capsys):
    run_dir, _, data = archive
    _experiment(work / "exps")
    args = [{"DATA": data, "EXPS": work / "exps"}.get(a, a) for a in command]
    rc, _, err = call([*args, "--run-dir", run_dir], capsys)
    # the command to list the ids names the run the user gave
    assert_one_line_error(rc, err, "archive.sqlite", "id", "'deadbeef'", f"archive list --run-dir {run_dir}")
    assert not (work / "go-out").exists() or not any((work / "go-out").iterdir())


def test_unknown_run_dir(work, capsys):
    rc, _, err = call(["archive", "show", "deadbeef", "--run-dir", "no-such-run"], capsys)
    assert_one_line_error(rc, err, "no-such-run", "--run-dir")


def test_validate_plots_into_the_run_directory_it_was_given(archive, work, capsys):
    """A copied run: the plot goes to the copy's plots folder, not to the folder the
    archive recorded when the run was made (another run's, or nowhere)."""
    import shutil

    run_dir, entry_id, _ = archive
    copy = work / "copied-run"
    shutil.copytree(run_dir, copy)
    _experiment(work / "exps")
    before = sorted((Path(run_dir) / "plots").glob("*.png")) if (Path(run_dir) / "plots").is_dir() else []
    rc, out, _ = call(["validate", entry_id, "--experiments", "exps", "--run-dir", str(copy)], capsys)
    assert rc == 0 and list((copy / "plots").glob(f"validate-{entry_id}*.png"))
    after = sorted((Path(run_dir) / "plots").glob("*.png")) if (Path(run_dir) / "plots").is_dir() else []
    assert after == before


@pytest.mark.parametrize(
    "damage, command, needles",
    [
        ("UPDATE entries SET payload = 'not json'", ["archive", "show", "ID"], ["entry", "damaged archive"]),
        ("UPDATE entries SET payload = '{}'", ["archive", "list"], ["entry", "damaged archive"]),
        ("DROP TABLE generations", ["archive", "best"], ["damaged archive", "no such table"]),
    ],
)
def test_a_damaged_archive_is_a_one_line_error(damage, command, needles, archive, work, capsys):
    import shutil
    import sqlite3

    run_dir, entry_id, _ = archive
    copy = work / "damaged-run"
    shutil.copytree(run_dir, copy)
    con = sqlite3.connect(copy / "archive.sqlite")
    con.execute(damage)
    con.commit()
    con.close()
    args = [entry_id if a == "ID" else a for a in command]
    rc, _, err = call([*args, "--run-dir", str(copy)], capsys)
    assert_one_line_error(rc, err, "archive.sqlite", *needles)
