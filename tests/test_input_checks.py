"""Inputs that parse but make no physical sense (issue 14): one line naming file and field, exit 2,
nothing written. The generated (hypothesis) cases are in ``test_input_properties.py``."""

import json
import sqlite3

import numpy as np
import pandas as pd
import pytest
from error_lines import assert_one_line_error, call, good_trace, run_args, set_cell
from test_bad_input import EXP_CONFIG, H100, LLAMA_7B, _experiment, _model_configs


def assert_nothing_written(root) -> None:
    assert not (root / "runs").exists(), sorted(p.name for p in (root / "runs").iterdir())


# --- model configs --------------------------------------------------------------------
@pytest.mark.parametrize(
    "case,change,needles",
    [
        ("negative_kv_heads", {"num_key_value_heads": -8}, ["num_key_value_heads", "positive"]),
        ("zero_kv_heads", {"num_key_value_heads": 0}, ["num_key_value_heads", "positive"]),
        ("kv_heads_not_dividing", {"num_key_value_heads": 5}, ["num_key_value_heads", "divide"]),
        ("zero_experts", {"num_local_experts": 0}, ["num_local_experts", "positive"]),
        ("text_boolean", {"tie_word_embeddings": "false"}, ["tie_word_embeddings", "true or false"]),
        ("fractional_size", {"hidden_size": 8192.7}, ["hidden_size", "integer"]),
        ("boolean_size", {"num_hidden_layers": True}, ["num_hidden_layers", "number"]),
        ("huge_vocab", {"vocab_size": 10**12}, ["vocab_size", "at most"]),
        ("topk_above_experts", {"num_local_experts": 4, "num_experts_per_tok": 8}, ["num_experts_per_tok"]),
        ("head_split", {"hidden_size": 4095}, ["hidden_size", "multiple"]),
    ],
)
def test_unphysical_model_config(case, change, needles, work, capsys):
    configs = _model_configs(work, {**LLAMA_7B, **change})
    rc, _, err = call(run_args("good.csv", "--model-configs", configs), capsys)
    assert_one_line_error(rc, err, "config.json", *needles)
    assert_nothing_written(work)


def test_two_config_folders_for_one_model_names_both(work, capsys):
    configs = _model_configs(work, LLAMA_7B)
    (configs / "llama-2-7b").mkdir()
    (configs / "llama-2-7b" / "config.json").write_text(json.dumps({**LLAMA_7B, "num_hidden_layers": 40}))
    rc, _, err = call(run_args("good.csv", "--model-configs", configs), capsys)
    assert_one_line_error(rc, err, "Llama-2-7b-hf/config.json", "llama-2-7b/config.json", "same model")


# --- GPU datasheets ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "case,memory,needles",
    [
        ("nan_bandwidth", {"capacity_gb": 80, "bandwidth_tb_s": float("nan")}, ["bandwidth_tb_s", "finite"]),
        ("inf_bandwidth", {"capacity_gb": 80, "bandwidth_tb_s": float("inf")}, ["bandwidth_tb_s", "finite"]),
        ("absurd_capacity", {"capacity_gb": 1e12, "bandwidth_tb_s": 3.35}, ["capacity_gb", "at most"]),
        ("boolean_capacity", {"capacity_gb": True, "bandwidth_tb_s": 3.35}, ["capacity_gb", "number"]),
    ],
)
def test_unphysical_datasheet(case, memory, needles, work, capsys):
    (work / "gpu.json").write_text(json.dumps({**H100, "memory": memory}))  # json writes NaN/Infinity
    rc, _, err = call(run_args("good.csv", "--gpu-datasheet", "gpu.json"), capsys)
    assert_one_line_error(rc, err, "gpu.json", *needles)
    assert_nothing_written(work)


def test_datasheet_sparsity_flag_is_a_boolean(work, capsys):
    (work / "gpu.json").write_text(json.dumps({**H100, "compute": {"bf16_tensor_core": 1979, "with_sparsity": "no"}}))
    rc, _, err = call(run_args("good.csv", "--gpu-datasheet", "gpu.json"), capsys)
    assert_one_line_error(rc, err, "gpu.json", "compute.with_sparsity", "true or false")


# --- step traces --------------------------------------------------------------------------
def _half(col, value):
    def change(df):
        df = df.astype({col: object})
        df.loc[len(df) // 2 :, col] = value
        return df

    return change


@pytest.mark.parametrize(
    "case,change,needles",
    [
        ("model_changes", _half("model", "llama-2-70b"), ["model", "'tiny'", "one per experiment"]),
        ("tp_changes", _half("tp", 2), ["tp", "'tiny'", "one per experiment"]),
        ("huge_tokens", lambda df: set_cell(df, 3, "batch.decode_tokens", 1e300), ["batch.decode_tokens", "at most"]),
        ("tp_3_for_70b", lambda df: df.assign(model="llama-2-70b", tp=3), ["tp", "TP 3", "64 attention heads"]),
        ("huge_tp", lambda df: df.assign(tp=4096), ["tp", "at most"]),
    ],
)
def test_unphysical_trace(case, change, needles, work, capsys):
    change(good_trace()).to_csv(work / "bad.csv", index=False)
    rc, _, err = call(run_args("bad.csv"), capsys)
    assert_one_line_error(rc, err, "bad.csv", *needles)
    assert_nothing_written(work)


def _requests(steps: pd.DataFrame) -> pd.DataFrame:
    """Per-request rows consistent with STEPS (decode-only: one token per request)."""
    rows = [
        (s, k) for s, n in zip(steps["step.id"], steps["batch.num_decode_reqs"], strict=True) for k in range(int(n))
    ]
    step, k = np.array(rows).T
    return pd.DataFrame(
        {"experiment_id": "tiny", "step.id": step, "progress": 200 + k, "new_tokens": 1, "input_len": 100 + k}
    ).assign(output_len=50)


def _run_primitives(run_dir) -> list[str]:
    """The primitives a finished run searched over, from its summary in the archive."""
    con = sqlite3.connect(run_dir / "archive.sqlite")
    try:
        return json.loads(con.execute("SELECT summary_json FROM runs").fetchone()[0])["primitives"]
    finally:
        con.close()


def test_consistent_per_request_detail_is_accepted_and_used(work, capsys):
    d = work / "trace"
    d.mkdir()
    good_trace().to_csv(d / "step_traces.csv", index=False)
    rc, _, err = call([*run_args("trace")[:-1], "runs/without"], capsys)
    assert rc == 0, err
    _requests(good_trace()).to_csv(d / "step_requests.csv", index=False)
    rc, _, err = call(run_args("trace"), capsys)
    assert rc == 0, err
    per_request = {"attention_work", "max_kv_tokens"}  # need each request's KV length
    assert per_request <= set(_run_primitives(work / "runs" / "x"))
    assert not per_request & set(_run_primitives(work / "runs" / "without"))


@pytest.mark.parametrize(
    "case,change,needles",
    [
        ("empty", lambda r: r.iloc[:0], ["no rows"]),
        ("missing_request", lambda r: r.iloc[1:], ["step.id", "requests", "expected the same"]),
        ("extra_tokens", lambda r: set_cell(r, 0, "new_tokens", 7), ["step.id", "new tokens"]),
    ],
)
def test_inconsistent_per_request_detail(case, change, needles, work, capsys):
    d = work / "trace"
    d.mkdir()
    good_trace().to_csv(d / "step_traces.csv", index=False)
    reqs = change(_requests(good_trace()))
    reqs.to_parquet(d / "step_requests.parquet", index=False) if case == "empty" else None
    if case != "empty":
        reqs.to_csv(d / "step_requests.csv", index=False)
    rc, _, err = call(run_args("trace"), capsys)
    assert_one_line_error(rc, err, "step_requests", *needles)
    assert_nothing_written(work)


# --- experiment folders ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "case,exp_config,needles",
    [
        ("zero_gmu", EXP_CONFIG + "gpu_memory_utilization: 0\n", ["gpu_memory_utilization", "(0, 1]"]),
        ("gmu_above_one", EXP_CONFIG + "gpu_memory_utilization: 1.5\n", ["gpu_memory_utilization", "(0, 1]"]),
        ("text_gmu", EXP_CONFIG + "gpu_memory_utilization: lots\n", ["gpu_memory_utilization", "number"]),
        ("huge_context", EXP_CONFIG.replace("4096", "1e300"), ["max_model_len", "at most"]),
        ("tp_3_for_70b", EXP_CONFIG.replace("7b", "70b").replace("parallelism: 1", "parallelism: 3"), ["TP 3"]),
    ],
)
def test_unphysical_experiment(case, exp_config, needles, work, capsys):
    _experiment(work / "exps", exp_config=exp_config)
    rc, _, err = call(run_args("good.csv", "--experiments", "exps"), capsys)
    assert_one_line_error(rc, err, "exp-config.yaml", *needles)
    assert_nothing_written(work)


@pytest.mark.parametrize("field,value", [("rate", "1e300"), ("duration", "1e9"), ("rate", "nan")])
def test_unbounded_load_stage(field, value, work, capsys):
    d = _experiment(work / "exps")
    cfg = d / "results" / "config.yaml"
    cfg.write_text(cfg.read_text().replace(f"{field}: {'1.0' if field == 'rate' else '5'}", f"{field}: {value}"))
    rc, _, err = call(run_args("good.csv", "--experiments", "exps"), capsys)
    assert_one_line_error(rc, err, "config.yaml", f"load.stages[0].{field}")
    assert_nothing_written(work)


def test_a_load_whose_token_stream_cannot_fit_in_memory(work, capsys):
    d = _experiment(work / "exps")
    cfg = d / "results" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("output_len: 20", "output_len: 9000000").replace("rate: 1.0", "rate: 100"))
    rc, _, err = call(run_args("good.csv", "--experiments", "exps"), capsys)
    assert_one_line_error(rc, err, "config.yaml", "output_len", "output tokens")
    assert_nothing_written(work)
