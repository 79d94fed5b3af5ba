"""Generated malformed inputs (hypothesis): model configs, GPU datasheets, step traces and
experiment folders with one field made nonsensical. Each must end as ONE line naming the
file and the field, exit status 2, and nothing written (issue 14, item 7)."""

import json
import os
import tempfile
from pathlib import Path

import yaml
from error_lines import assert_one_line_error, call, good_trace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bad_input import EXP_CONFIG, H100, LLAMA_7B, _experiment

from primitives.data.traces import NUMERIC_COLUMNS

SETTINGS = settings(
    max_examples=int(os.environ.get("STEPSYNTH_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

# values no count, size or rate may take: not positive, not finite, not numbers, absurdly large
NONSENSE = st.one_of(
    st.integers(max_value=0),
    st.floats(max_value=0.0, allow_nan=False),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e300, True, False, "fast", "", [], {}]),
)
# whole-number fields also refuse fractions
NOT_AN_INTEGER = st.one_of(NONSENSE, st.floats(min_value=0.01, max_value=1e6).filter(lambda v: v != int(v)))


def run_in(root: Path, *extra) -> list:
    good_trace().to_csv(root / "good.csv", index=False)
    return ["run", "--generations", "1", "--population", "8", "--data", root / "good.csv"] + [
        "--run-dir",
        root / "runs" / "x",
        *extra,
    ]


def assert_refused(rc, err, root: Path, *needles) -> None:
    assert_one_line_error(rc, err, *needles)
    assert not (root / "runs").exists()


MODEL_FIELDS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]


@SETTINGS
@given(
    field=st.sampled_from([*MODEL_FIELDS, "num_key_value_heads", "num_local_experts", "head_dim"]),
    value=NOT_AN_INTEGER,
)
def test_generated_bad_model_config(field, value, capsys):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = root / "configs" / "Llama-2-7b-hf"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({**LLAMA_7B, field: value}))
        rc, _, err = call(run_in(root, "--model-configs", root / "configs"), capsys)
        assert_refused(rc, err, root, "config.json", field)


@SETTINGS
@given(value=st.one_of(st.integers(), st.floats(), st.text(max_size=5), st.sampled_from(["false", "true", 0, 1])))
def test_generated_non_boolean_flag(value, capsys):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = root / "configs" / "Llama-2-7b-hf"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({**LLAMA_7B, "tie_word_embeddings": value}))
        rc, _, err = call(run_in(root, "--model-configs", root / "configs"), capsys)
        assert_refused(rc, err, root, "config.json", "tie_word_embeddings", "true or false")


DATASHEET_FIELDS = [
    ("memory", "capacity_gb"),
    ("memory", "bandwidth_tb_s"),
    ("interconnect", "nvlink_bandwidth_gb_s"),
    ("compute", "bf16_tensor_core"),
]


@SETTINGS
@given(where=st.sampled_from(DATASHEET_FIELDS), value=NONSENSE)
def test_generated_bad_datasheet(where, value, capsys):
    section, key = where
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sheet = json.loads(json.dumps(H100))
        sheet[section][key] = value
        (root / "gpu.json").write_text(json.dumps(sheet))
        rc, _, err = call(run_in(root, "--gpu-datasheet", root / "gpu.json"), capsys)
        assert_refused(rc, err, root, "gpu.json", f"{section}.{key}")


TRACE_COLUMNS = list(NUMERIC_COLUMNS)  # every numeric column of a step trace
TRACE_NONSENSE = st.one_of(
    st.integers(max_value=-1),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e300, "many", "1,5"]),
)


@SETTINGS
@given(column=st.sampled_from(TRACE_COLUMNS), row=st.integers(0, 39), value=TRACE_NONSENSE)
def test_generated_bad_trace_cell(column, row, value, capsys):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        df = good_trace().astype({column: object})
        df.loc[row, column] = value
        df.to_csv(root / "bad.csv", index=False)
        args = run_in(root)
        args[args.index(root / "good.csv")] = root / "bad.csv"
        rc, _, err = call(args, capsys)
        assert_refused(rc, err, root, "bad.csv", column)


EXP_FIELDS = ["tensor_parallelism", "max_model_len", "max_num_batched_tokens", "max_num_seqs"]


@SETTINGS
@given(field=st.sampled_from([*EXP_FIELDS, "gpu_memory_utilization"]), value=NOT_AN_INTEGER)
def test_generated_bad_experiment_folder(field, value, capsys):
    if field == "gpu_memory_utilization" and isinstance(value, float) and 0 < value <= 1:
        value = 1.0 + value  # a fraction is valid there; beyond 1 is not
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = {**yaml.safe_load(EXP_CONFIG), field: value}
        _experiment(root / "exps", exp_config=yaml.safe_dump(config))
        rc, _, err = call(run_in(root, "--experiments", root / "exps"), capsys)
        assert_refused(rc, err, root, "exp-config.yaml", field)
