"""The least a KV byte costs: the measured kernel's typical (median) marginal price as the
lower bound of ``kv_io_time_us``'s fitted efficiency (``primitives.kernels``,
``fitness.efficiency``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_kv_price_cap import CAP, HBM_BYTES_PER_US, kernels_folder
from test_physics_bounds import OP, V
from test_search import planted_table

from fitness.efficiency import EfficiencyBounds, run_efficiency_bounds
from fitness.physics_check import term_efficiencies
from fitness.scoring import FitnessContext, score_program
from primitives.deployment import default_resolver
from primitives.errors import InputError
from primitives.kernels import efficiency_caps, efficiency_floors

FLOORED = EfficiencyBounds(1.0, 4.0, CAP.caps, (("kv_io_time_us", 1.055),))


def test_the_floor_is_the_median_marginal_price_and_the_cap_its_dear_end(tmp_path):
    folder = tmp_path / "k"
    folder.mkdir()
    kernels = kernels_folder(folder, 1.1)
    # one price per batch: 1.0, 1.1 and 1.3 for batches 1, 16 and 64, so the median and the
    # 95th percentile differ
    table = folder / "attention_decode" / "8-8-128-tp2.csv"
    lines = table.read_text().splitlines()
    price = {"1": 1.0, "16": 1.1, "64": 1.3}
    rows = [lines[0]]
    for line in lines[1:]:
        dtype, kv_dtype, batch, context, _, mfu = line.split(",")
        roofline_us = int(batch) * int(context) * 2 * 4 * 128 * 2 / HBM_BYTES_PER_US
        rows.append(f"{dtype},{kv_dtype},{batch},{context},{25 + price[batch] * roofline_us:.6f},{mfu}")
    table.write_text("\n".join(rows) + "\n")
    kernels = type(kernels)(folder)
    # the context steps whose added bytes take >= 20 µs at the roofline: batch 1's last, all of 16's and 64's
    prices = [1.0] + [1.1] * 3 + [1.3] * 3
    assert kernels.kv_byte_price(HBM_BYTES_PER_US, 0.5) == pytest.approx(np.median(prices), rel=1e-6)
    assert kernels.kv_byte_price(HBM_BYTES_PER_US) == pytest.approx(np.quantile(prices, 0.95), rel=1e-6)
    resolver = default_resolver()
    h100 = resolver.gpu(resolver.default_gpu)
    assert efficiency_floors([h100]) == {"kv_io_time_us": 1.0549}
    assert efficiency_caps([h100]) == {"decode_attention_time_us": 1.0996, "kv_io_time_us": 1.16}
    no_kernels = type(h100)(h100.name, h100.dense_flops_per_s, h100.hbm_bytes_per_s, h100.nvlink_bytes_per_s, 1.0)
    assert efficiency_floors([no_kernels]) == {}
    made_up = type(h100)(
        h100.name, h100.dense_flops_per_s, h100.hbm_bytes_per_s, h100.nvlink_bytes_per_s, 1.0, str(folder)
    )
    # two GPUs: the floor is the lower of their medians, the cap the higher 95th percentile
    assert efficiency_floors([h100, made_up]) == {"kv_io_time_us": 1.0549}
    cap = np.quantile(prices, 0.95)
    assert efficiency_caps([h100, made_up]) == {
        "kv_io_time_us": pytest.approx(cap, abs=1e-4),
        "decode_attention_time_us": pytest.approx(round(cap, 4) / 1.0549, abs=1e-4),
    }


def test_a_primitive_is_floored_only_where_it_has_a_floor_and_the_interval_is_never_empty():
    assert FLOORED.of("kv_io_time_us") == (1.055, 1.16)
    assert FLOORED.of("gemm_time_us") == (1.0, 4.0)
    assert FLOORED.of("weight_time_us") == (1.0, 4.0)
    above = EfficiencyBounds(1.0, 4.0, CAP.caps, (("kv_io_time_us", 1.3),))
    assert above.of("kv_io_time_us") == (1.16, 1.16)  # a floor above the cap: pinned at the cap
    assert EfficiencyBounds(1.2, 4.0, (), (("kv_io_time_us", 1.1),)).of("kv_io_time_us") == (1.2, 4.0)
    assert FLOORED.describe() == "1-4; kv_io_time_us 1.055-1.16"
    assert EfficiencyBounds(1.0, 4.0, (), FLOORED.floors).describe() == "1-4; kv_io_time_us at least 1.055"


def test_the_fit_holds_kv_io_at_its_floor_and_flags_it():
    table = planted_table(noise=0.0)  # truth: 1.3 weight + 1.5 kv_io + 40 calls + 1500
    prog = (OP("add"), OP("add"), V("weight_time_us"), V("kv_io_time_us"), V("allreduce_calls"))
    bounds = EfficiencyBounds(1.0, 4.0, (), (("kv_io_time_us", 1.7),))
    floored = score_program(prog, FitnessContext(table, efficiency_bounds=bounds))
    assert floored.ok and floored.coefficients[1] == pytest.approx(1.7)
    free = score_program(prog, FitnessContext(table, efficiency_bounds=(1.0, 4.0)))
    assert free.coefficients[1] == pytest.approx(1.5, rel=1e-6)
    row = next(
        r for r in term_efficiencies("1.7*kv_io_time_us + 1.3*weight_time_us", bounds) if r["term"] == "kv_io_time_us"
    )
    assert (row["on_bound"], row["lower"]) == ("lower", 1.7)


def test_runs_record_and_carry_their_floors_and_a_resumed_older_run_gains_none():
    from evolve.config import RunConfig
    from evolve.run import prepare_context

    config = RunConfig(generations=1)
    ctx, _, _ = prepare_context(config, default_resolver())
    assert config.efficiency_floors == efficiency_floors([default_resolver().gpu(default_resolver().default_gpu)])
    assert ctx.efficiency_bounds.floors == tuple(config.efficiency_floors.items())
    older = RunConfig(generations=1, efficiency_caps=dict(CAP.caps), efficiency_floors={})  # as resume reads it
    told: list[str] = []
    ctx, _, _ = prepare_context(older, default_resolver(), told.append)
    assert older.efficiency_floors == {} and ctx.efficiency_bounds.floors == ()
    # it keeps its own bounds, and says where today's differ (the decode-attention cap came later)
    assert told == ["kept the run's own efficiency bounds; today's differ on decode_attention_time_us, kv_io_time_us"]
    told.clear()
    prepare_context(config, default_resolver(), told.append)  # today's own bounds: nothing to say
    assert told == []
    saved = {
        "efficiency_bounds": [1.0, 4.0],
        "efficiency_caps": dict(CAP.caps),
        "efficiency_floors": {"kv_io_time_us": 1.055},
    }
    assert run_efficiency_bounds(saved) == FLOORED
    assert run_efficiency_bounds({"efficiency_bounds": [1.0, 4.0]}).floors == ()  # a run from before the floors


def test_a_merged_coefficient_outside_its_bounds_is_flagged():
    # the bounds hold per additive term: two kv_io terms, each on its floor, archive as one
    # term at 2.11 (seen on a trace run's front); archive show must say it is not physical
    bounds = EfficiencyBounds(1.0, 4.0, (("kv_io_time_us", 1.16),), (("kv_io_time_us", 1.055),))
    row = term_efficiencies("2.1098*kv_io_time_us + 1.3*weight_time_us", bounds)[0]
    assert row["outside_bounds"] and row["on_bound"] is None
    inside = term_efficiencies("1.16*kv_io_time_us + 1.3*weight_time_us", bounds)
    assert [(r["outside_bounds"], r["on_bound"]) for r in inside] == [(False, "upper"), (False, None)]
    # one wording for archive show, the HTML report and the primitives table
    from fitness.physics_check import bound_flag

    assert bound_flag(row) == "OUTSIDE its bounds (1.055-1.16)"
    assert [bound_flag(r) for r in inside] == ["on the upper bound (1.16)", ""]
    rows = {r["term"]: r for r in term_efficiencies("-1.2*weight_time_us + 1.1*kv_io_time_us", bounds)}
    assert bound_flag(rows["weight_time_us"]) == "NEGATIVE" and bound_flag(rows["kv_io_time_us"]) == ""


def test_a_run_from_before_the_floors_resumes_without_them_and_bad_floors_are_refused(tmp_path):
    from evolve.resume import _saved_config

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"generations": 5, "population": 10, "seed": 0}))
    assert _saved_config(path).efficiency_floors == {}
    for bad, field in (([1.055], "efficiency_floors"), ({"kv_io_time_us": "x"}, "efficiency_floors.kv_io_time_us")):
        path.write_text(json.dumps({"generations": 5, "population": 10, "seed": 0, "efficiency_floors": bad}))
        with pytest.raises(InputError, match=field):
            _saved_config(path)
