"""Measured-kernel primitives: tables reproduce the measurements, stay monotone, price MoE and TP."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from evolve.cli import main
from primitives.compute import kernel_binding, primitive_columns
from primitives.deployment import DeploymentResolver, default_resolver
from primitives.errors import InputError
from primitives.kernels import BATCH_GRID, CONTEXT_GRID, TOKEN_GRID, builtin_kernel_dir, measured_kernels

R = default_resolver()
KERNELS = builtin_kernel_dir("H100 SXM")


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_on_grid_matmul_is_the_measurement():
    k = measured_kernels(KERNELS)
    for row in _csv(f"{KERNELS}/gemm.csv")[::7]:
        got = float(k.gemm_us(np.array(float(row["m"])), float(row["k"]), float(row["n"])))
        assert got == pytest.approx(float(row["latency_us"]), rel=1e-9)


def test_decode_table_reproduces_a_measured_point_per_layer():
    dep = R.resolve("llama-2-70b", 4)  # 64-8-128 at TP4
    rows = {
        (float(r["batch_size"]), float(r["kv_len"])): float(r["latency_us"])
        for r in _csv(f"{KERNELS}/attention_decode/64-8-128-tp4.csv")
    }
    per_layer = dep.kernels.decode_attention(64.0, 4096.0) / dep.model.n_layers
    assert per_layer == pytest.approx(rows[(64.0, 4096.0)], rel=1e-6)
    assert 64.0 in BATCH_GRID.points and 4096.0 in CONTEXT_GRID.points


@pytest.mark.parametrize(
    "model,tp", [("llama-2-7b", 1), ("llama-2-70b", 4), ("codellama-34b", 2), ("mixtral-8x7b-v0-1", 2)]
)
def test_tables_are_monotone_and_zero_without_work(model, tp):
    t = R.resolve(model, tp).kernels
    tokens = TOKEN_GRID.points
    assert np.all(np.diff(t.gemm(tokens)) >= 0) and np.all(np.diff(t.prefill_attention(tokens)) >= 0)
    b, c = np.meshgrid(np.geomspace(1, 1024, 40), np.geomspace(16, 131072, 40), indexing="ij")
    z = t.decode_attention(b, c)
    assert np.all(np.diff(z, axis=0) >= -1e-9) and np.all(np.diff(z, axis=1) >= -1e-9)
    assert t.gemm(0.0) == 0.0 and t.decode_attention(0.0, 500.0) == 0.0 and t.prefill_attention(0.0) == 0.0


def test_small_batches_are_weight_bound_and_large_ones_compute_bound():
    t = R.resolve("llama-2-70b", 4).kernels
    assert t.gemm(64.0) / t.gemm(1.0) < 1.05  # reading the weights dominates
    assert t.gemm(8192.0) / t.gemm(4096.0) == pytest.approx(2.0, rel=0.1)  # FLOPs dominate


def test_moe_step_pays_for_the_experts_its_tokens_touch():
    t = R.resolve("mixtral-8x7b-v0-1", 2).kernels
    # one token reaches 2 of 8 experts; 64 tokens reach nearly all of them
    assert 2.5 < t.gemm(64.0) / t.gemm(1.0) < 4.5


def test_tensor_parallelism_shards_the_work():
    k70 = [R.resolve("llama-2-70b", tp).kernels for tp in (2, 4)]
    assert k70[1].gemm(2048.0) < 0.6 * k70[0].gemm(2048.0)
    assert k70[1].decode_attention(128.0, 2000.0) < k70[0].decode_attention(128.0, 2000.0)


def test_primitive_columns_bind_each_rows_deployment():
    deps = [R.resolve("llama-2-7b", 1), R.resolve("llama-2-70b", 4)]
    feats = {
        "prefill_tokens": np.array([512.0, 512.0]),
        "decode_tokens": np.array([32.0, 32.0]),
        "num_prefill_reqs": np.array([1.0, 1.0]),
        "num_decode_reqs": np.array([32.0, 32.0]),
        "kv_tokens": np.array([20000.0, 20000.0]),
    }
    names = ["gemm_time_us", "decode_attention_time_us", "prefill_attention_time_us"]
    from primitives.compute import constant_columns

    row_dep = np.array([0, 1])
    mixed = primitive_columns(feats, constant_columns(deps, row_dep), names, kernel_binding(names, deps, row_dep))
    for i, dep in enumerate(deps):
        one = primitive_columns(
            {k: v[i : i + 1] for k, v in feats.items()}, dep.constants, names, kernel_binding(names, [dep])
        )
        for n in names:
            assert mixed[n][i] == pytest.approx(one[n][0], rel=1e-12)
    # decode attention at 32 requests of (20000 - 512) / 32 tokens each
    want = deps[1].kernels.decode_attention(32.0, (20000.0 - 512.0) / 32.0)
    assert mixed["decode_attention_time_us"][1] == pytest.approx(want, rel=1e-12)


def test_kernels_folder_option(tmp_path):
    with pytest.raises(InputError, match="gemm.csv"):
        DeploymentResolver.from_options(kernels=tmp_path)
    other = DeploymentResolver.from_options(kernels=KERNELS)
    assert other.resolve("llama-2-70b", 4).kernels.gemm(100.0) == R.resolve("llama-2-70b", 4).kernels.gemm(100.0)


def test_bad_kernels_folder_is_one_line(tmp_path, capsys):
    assert main(["run", "--generations", "1", "--kernels", str(tmp_path), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gemm.csv" in err[0]


def _kernels_copy(tmp_path):
    import shutil

    shutil.copytree(KERNELS, tmp_path / "k")
    return tmp_path / "k"


def _damage_empty_gemm(k):
    (k / "gemm.csv").write_text("")


def _damage_header_only_decode(k):
    p = next((k / "attention_decode").glob("*.csv"))
    p.write_text(p.read_text().splitlines()[0] + "\n")


def _damage_binary_gemm(k):
    (k / "gemm.csv").write_bytes(b"m,k,n,latency_us\n\xff\xfe\x00\x01\n")


def _damage_fifo_decode(k):
    import os

    p = next((k / "attention_decode").glob("*.csv"))
    p.unlink()
    os.mkfifo(p)


def _damage_stray_decode_name(k):
    p = next((k / "attention_decode").glob("*.csv"))
    (p.parent / (p.stem + "-old.csv")).write_text(p.read_text())


def _damage_zero_heads_prefill(k):
    p = next((k / "attention_prefill").glob("*.csv"))
    p.rename(p.parent / ("0-" + p.name.split("-", 1)[1]))


def _damage_repeated_prefill_length(k):
    p = next((k / "attention_prefill").glob("*.csv"))
    lines = p.read_text().splitlines()
    p.write_text("\n".join([lines[0], lines[1], lines[1], *lines[2:]]) + "\n")


def _damage_decode_name_without_tp(k):
    p = next((k / "attention_decode").glob("*.csv"))
    p.rename(p.parent / (p.stem.rsplit("-", 1)[0] + ".csv"))


def _damage_gemm_shape_twice(k):
    lines = (k / "gemm.csv").read_text().splitlines()
    (k / "gemm.csv").write_text("\n".join([*lines, lines[1]]) + "\n")


def _damage_fractional_gemm_m(k):
    lines = (k / "gemm.csv").read_text().splitlines()
    first = lines[1].split(",")
    (k / "gemm.csv").write_text("\n".join([lines[0], ",".join(["8.5", *first[1:]]), *lines[2:]]) + "\n")


def _damage_huge_gemm_m(k):
    lines = (k / "gemm.csv").read_text().splitlines()
    first = lines[1].split(",")
    (k / "gemm.csv").write_text("\n".join([lines[0], ",".join(["1e30", *first[1:]]), *lines[2:]]) + "\n")


def _damage_one_row_prefill(k):
    p = next((k / "attention_prefill").glob("*.csv"))
    p.write_text("\n".join(p.read_text().splitlines()[:2]) + "\n")


def _damage_cut_gemm(k):
    text = (k / "gemm.csv").read_text()
    (k / "gemm.csv").write_text(text[: len(text) // 2].rsplit(",", 1)[0])  # cut mid-row, in its third field


@pytest.mark.parametrize(
    "damage, what",
    [
        (_damage_empty_gemm, "gemm.csv: the file is empty"),
        (_damage_cut_gemm, "no latency_us, mfu; expected one value per header field (a cut file?)"),
        (_damage_header_only_decode, "expected a header and at least one row"),
        (_damage_binary_gemm, "not a text file"),
        (_damage_fifo_decode, "expected a file"),
        (_damage_stray_decode_name, "expected a table name like 64-8-128-tp4.csv"),
        (_damage_zero_heads_prefill, "expected a table name like 64-8-128.csv"),
        (_damage_one_row_prefill, "two sequence lengths"),
        (_damage_gemm_shape_twice, "a shape timed twice"),
        (_damage_fractional_gemm_m, "gemm.csv: m: expected an integer, got 8.5"),
        (_damage_huge_gemm_m, "gemm.csv: m: expected at most"),
        (_damage_repeated_prefill_length, "each length once"),
        (_damage_decode_name_without_tp, "expected a table name like 64-8-128-tp4.csv"),
    ],
)
def test_a_damaged_kernels_folder_is_a_one_line_error_before_any_work(tmp_path, capsys, damage, what):
    k = _kernels_copy(tmp_path)
    damage(k)
    assert main(["run", "--generations", "1", "--kernels", str(k), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and what in err[0], err
    assert not (tmp_path / "r").exists()


def test_a_short_row_is_named_by_the_line_it_starts_on(tmp_path):
    from primitives.kernels import _read_csv

    table = tmp_path / "gemm.csv"
    table.write_text('m,k,note\n1,2,"two\nlines"\n3,"4\n5"\n')  # rows on lines 2-3 and 4-5, the second short
    with pytest.raises(InputError, match="line 4: no note"):
        _read_csv(table)


def test_a_table_cut_inside_a_quoted_value_is_refused(tmp_path):
    from primitives.kernels import _read_csv

    table = tmp_path / "gemm.csv"
    table.write_text('m,k,note\n1,2,"abc\ndef\n')  # the quote never closes: the file was cut
    with pytest.raises(InputError, match="not a readable CSV table"):
        _read_csv(table)
