"""The price of a KV byte from the measured decode-attention kernel, and the cap it puts on
``kv_io_time_us``'s fitted efficiency (``primitives.kernels``, ``fitness.efficiency``)."""

from __future__ import annotations

import pytest
from test_physics_bounds import OP, V
from test_search import planted_table

from fitness.efficiency import EfficiencyBounds, run_efficiency_bounds
from fitness.physics_check import term_efficiencies
from fitness.scoring import FitnessContext, score_program
from primitives.deployment import default_resolver
from primitives.errors import InputError
from primitives.kernels import MeasuredKernels, efficiency_caps

HBM_BYTES_PER_US = 3.35e6
CAP = EfficiencyBounds(1.0, 4.0, (("kv_io_time_us", 1.16),))


def kernels_folder(tmp_path, price: float, dtype: str = "bf16", floor_us: float = 25.0):
    """A kernels folder whose decode latency is a launch floor plus ``price`` x the KV roofline."""
    (tmp_path / "gemm.csv").write_text("m,k,n,latency_us,mfu\n8,4096,6144,10,0.1\n1024,4096,6144,60,0.5\n")
    (tmp_path / "attention_prefill").mkdir()
    (tmp_path / "attention_prefill" / "8-8-128.csv").write_text(
        "dtype,seq_len,latency_us,mfu\nbf16,512,20,0.1\nbf16,4096,200,0.4\n"
    )
    (tmp_path / "attention_decode").mkdir()
    rows = ["dtype,kv_dtype,batch_size,kv_len,latency_us,mfu"]
    bytes_per_token = 2 * (8 / 2) * 128 * {"bf16": 2, "fp8": 1}.get(dtype, 2)  # 8 KV heads at TP2
    for batch in (1, 16, 64):
        for context in (1024, 4096, 16384, 65536):
            roofline_us = batch * context * bytes_per_token / HBM_BYTES_PER_US
            rows.append(f"bf16,{dtype},{batch},{context},{floor_us + price * roofline_us:.6f},0.1")
    (tmp_path / "attention_decode" / "8-8-128-tp2.csv").write_text("\n".join(rows) + "\n")
    return MeasuredKernels(tmp_path)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_the_kv_byte_price_is_the_marginal_cost_not_the_launch_floor(tmp_path, dtype):
    # latency / roofline would be far above 1.1 at small batches (the 25 µs floor); the
    # marginal price of the bytes a longer context adds is exactly 1.1
    k = kernels_folder(tmp_path, 1.1, dtype)
    assert k.kv_byte_price(HBM_BYTES_PER_US) == pytest.approx(1.1, rel=1e-6)


def test_an_unknown_kv_dtype_is_a_one_line_input_error_when_the_folder_is_read(tmp_path):
    with pytest.raises(InputError, match="kv_dtype"):
        kernels_folder(tmp_path, 1.1, "int3")


def test_h100s_measured_kernels_price_a_kv_byte_near_its_roofline():
    resolver = default_resolver()
    gpu = resolver.gpu(resolver.default_gpu)
    caps = efficiency_caps([gpu])
    assert set(caps) == {"kv_io_time_us", "decode_attention_time_us"}
    assert 1.0 < caps["kv_io_time_us"] < 1.3  # 1.16 on H100: bandwidth-bound, 16% dearer at the 95th percentile
    # the kernel's own KV byte costs the median price (1.0549): 1.0996 of it is the same cap
    assert caps["decode_attention_time_us"] == pytest.approx(1.16 / 1.0549, abs=1e-4)
    no_kernels = type(gpu)(gpu.name, gpu.dense_flops_per_s, gpu.hbm_bytes_per_s, gpu.nvlink_bytes_per_s, 1.0)
    assert efficiency_caps([no_kernels]) == {}


def test_a_gpu_whose_decode_tables_are_all_launch_bound_has_no_cap(tmp_path):
    kernels_folder(tmp_path, 1.1)
    table = tmp_path / "attention_decode" / "8-8-128-tp2.csv"
    lines = table.read_text().splitlines()
    table.write_text("\n".join(lines[:3]) + "\n")  # batch 1, contexts 1024 and 4096: a few µs of roofline
    resolver = default_resolver()
    gpu = resolver.gpu(resolver.default_gpu)
    short = type(gpu)(gpu.name, gpu.dense_flops_per_s, gpu.hbm_bytes_per_s, gpu.nvlink_bytes_per_s, 1.0, str(tmp_path))
    assert efficiency_caps([short]) == {}


def test_only_a_capped_primitive_is_capped():
    assert CAP.of("kv_io_time_us") == (1.0, 1.16)
    assert CAP.of("gemm_time_us") == (1.0, 4.0)
    assert CAP.of("weight_time_us") == (1.0, 4.0)
    assert EfficiencyBounds(1.2, 4.0, CAP.caps).of("kv_io_time_us") == (1.2, 1.2)  # never below the lower bound
    lo, hi = CAP
    assert (lo, hi) == (1.0, 4.0)


def test_the_fit_holds_kv_io_at_its_cap_and_the_rest_at_the_run_bounds():
    table = planted_table(noise=0.0)  # truth: 1.3 weight + 1.5 kv_io + 40 calls + 1500
    prog = (OP("add"), OP("add"), V("weight_time_us"), V("kv_io_time_us"), V("allreduce_calls"))
    capped = score_program(prog, FitnessContext(table, efficiency_bounds=CAP))
    assert capped.coefficients[1] == pytest.approx(1.16)
    assert 1.0 <= capped.coefficients[0] <= 4.0
    free = score_program(prog, FitnessContext(table, efficiency_bounds=(1.0, 4.0)))
    assert free.coefficients[1] == pytest.approx(1.5, rel=1e-6)


def test_a_cap_below_the_lower_bound_pins_the_term_there():
    # --efficiency-bounds 1.2,4 with a 1.16 cap: kv_io is held at 1.2, not refused
    table = planted_table(noise=0.0)
    prog = (OP("add"), OP("add"), V("weight_time_us"), V("kv_io_time_us"), V("allreduce_calls"))
    pinned = score_program(prog, FitnessContext(table, efficiency_bounds=EfficiencyBounds(1.2, 4.0, CAP.caps)))
    assert pinned.ok and pinned.coefficients[1] == pytest.approx(1.2)
    row = term_efficiencies("1.2*kv_io_time_us", EfficiencyBounds(1.2, 4.0, CAP.caps))[0]
    assert row["on_bound"] == "upper"


def test_runs_carry_their_caps_and_the_table_flags_a_term_on_its_cap():
    bounds = run_efficiency_bounds({"efficiency_bounds": [1.0, 4.0], "efficiency_caps": {"kv_io_time_us": 1.16}})
    assert bounds == CAP
    assert run_efficiency_bounds({"efficiency_bounds": [1.0, 4.0]}).caps == ()  # a run from before the caps
    rows = term_efficiencies("1.16*kv_io_time_us + 1.3*gemm_time_us + 1500.0*tp", bounds)
    kv, gemm, tp = (next(r for r in rows if r["term"] == t) for t in ("kv_io_time_us", "gemm_time_us", "tp"))
    assert (kv["on_bound"], kv["upper"]) == ("upper", 1.16)
    assert (gemm["on_bound"], gemm["upper"]) == (None, 4.0)
    assert tp["kind"] == "count" and tp["upper"] is None
    assert bounds.describe() == "1-4; kv_io_time_us at most 1.16"


def test_a_run_records_the_caps_of_its_gpus_kernels():
    from evolve.config import RunConfig
    from evolve.run import prepare_context

    config = RunConfig(generations=1)
    ctx, _, _ = prepare_context(config, default_resolver())
    assert config.efficiency_caps == efficiency_caps([default_resolver().gpu(default_resolver().default_gpu)])
    assert ctx.efficiency_bounds.caps == tuple(config.efficiency_caps.items())


def test_a_run_from_before_the_caps_resumes_without_them_and_bad_caps_are_refused(tmp_path):
    import json

    from evolve.resume import _saved_config

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"generations": 5, "population": 10, "seed": 0}))
    assert _saved_config(path).efficiency_caps == {}
    path.write_text(json.dumps({"generations": 5, "population": 10, "seed": 0, "efficiency_caps": [1.16]}))
    with pytest.raises(InputError, match="efficiency_caps"):
        _saved_config(path)
    path.write_text(
        json.dumps({"generations": 5, "population": 10, "seed": 0, "efficiency_caps": {"kv_io_time_us": "x"}})
    )
    with pytest.raises(InputError, match="efficiency_caps.kv_io_time_us"):
        _saved_config(path)
