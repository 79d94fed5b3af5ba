"""Primitives against hand-computed values for the four real model configs."""

import json
import re

import numpy as np
import pytest

from primitives.compute import BatchPrimitives, features_from_requests
from primitives.deployment import DeploymentResolver, ModelCatalog, canonical_model_key, default_resolver
from primitives.errors import InputError
from primitives.registry import AGGREGATE_FEATURES, PRIMITIVES, supported_primitives

H100_BW = 3.35e12
H100_DENSE = 989.5e12


def test_llama70b_weight_bytes_per_gpu_at_tp4():
    d = default_resolver().resolve("llama-2-70b", 4)
    # per layer: q,o 2*8192^2; k,v 2*8192*1024; mlp 3*8192*28672; norms 2*8192
    per_layer = 2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    params = 80 * per_layer + 2 * 32000 * 8192 + 8192
    assert d.model.total_params == params == 68_976_648_192
    assert d.weight_bytes_per_gpu == pytest.approx(params * 2 / 4)  # ~34.5 GB, NOTES §1
    prims = BatchPrimitives(d, ["weight_time_us"])([0], [1], [10], [0])
    assert prims["weight_time_us"][0] == pytest.approx(params * 2 / 4 / H100_BW * 1e6)  # ~10.3 ms


@pytest.mark.parametrize(
    "name,tp,layers,kv_heads,params_b",
    [
        ("llama-2-7b", 1, 32, 32, 6.738),
        ("codellama-34b", 2, 48, 8, 33.744),
        ("mixtral-8x7b-v0-1", 2, 32, 8, 46.703),
        ("llama-2-70b", 4, 80, 8, 68.977),
    ],
)
def test_models_resolve_with_their_architecture(name, tp, layers, kv_heads, params_b):
    d = default_resolver().resolve(name, tp)
    assert d.model.n_layers == layers
    assert d.model.n_kv_heads == kv_heads
    assert d.model.total_params / 1e9 == pytest.approx(params_b, abs=1e-3)
    # KV bytes per token per GPU: 2 (K,V) * layers * kv_heads * 128 * 2 bytes / tp
    assert d.kv_bytes_per_token_per_gpu == 2 * layers * kv_heads * 128 * 2 / tp


def test_kv_capacity_matches_the_real_block_counts():
    r = default_resolver()
    # vLLM reported 31,356 blocks (70B TP4) and 26,602 (34B TP2) in the real traces
    assert r.resolve("llama-2-70b", 4).kv_capacity_blocks() == pytest.approx(31356, rel=0.002)
    assert r.resolve("codellama-34b", 2).kv_capacity_blocks() == pytest.approx(26602, rel=0.002)


def test_mixtral_moe_ratios_and_dense_gives_one():
    r = default_resolver()
    mix = r.resolve("mixtral-8x7b-v0-1", 2)
    bp = BatchPrimitives(mix, ["moe_topk_ratio", "moe_touched_fraction", "matmul_time_us"])
    one = bp([100], [1], [50], [3])  # a single decode token touches 2 of 8 experts
    assert one["moe_topk_ratio"][0] == pytest.approx(0.25)
    assert one["moe_touched_fraction"][0] == pytest.approx(0.25)
    many = bp([100] * 8, [1] * 8, [50] * 8, [3] * 8)
    assert many["moe_touched_fraction"][0] == pytest.approx(1 - 0.75**8)
    # active params: attention + 2 of 8 experts + router, per layer, over TP2
    m = mix.model
    active = 32 * (m.attention_params_per_layer + 2 * 3 * 4096 * 14336 + 4096 * 8)
    assert one["matmul_time_us"][0] == pytest.approx(2 * active / 2 / H100_DENSE * 1e6)
    dense = BatchPrimitives(r.resolve("llama-2-7b", 1), ["moe_topk_ratio", "moe_touched_fraction"])
    out = dense([0, 5], [10, 1], [10, 4], [0, 1])
    assert out["moe_topk_ratio"][0] == 1.0 and out["moe_touched_fraction"][0] == 1.0


def test_batch_features_follow_blis_request_fields():
    # request A: prefill chunk of 100 at progress 200 (prompt 500); B, C decoding
    progress = np.array([200, 600, 900])
    new = np.array([100, 1, 1])
    inp = np.array([500, 550, 560])
    out = np.array([0, 50, 340])
    f = features_from_requests(np.zeros(3, int), progress, new, inp, out, 1)
    assert f["prefill_tokens"][0] == 100 and f["decode_tokens"][0] == 2
    assert f["num_prefill_reqs"][0] == 1 and f["num_decode_reqs"][0] == 2
    assert f["kv_tokens"][0] == 300 + 601 + 901
    assert f["max_kv_tokens"][0] == 901
    assert f["attention_work"][0] == 100 * (200 + 50) + 1 * (600 + 0.5) + 1 * (900 + 0.5)


def test_allreduce_is_zero_at_tp1_and_positive_above():
    r = default_resolver()
    names = ["allreduce_time_us", "allreduce_calls"]
    tp1 = BatchPrimitives(r.resolve("llama-2-7b", 1), names)([10], [1], [5], [5])
    tp4 = BatchPrimitives(r.resolve("llama-2-70b", 4), names)([10], [1], [5], [5])
    assert tp1["allreduce_time_us"][0] == 0 and tp1["allreduce_calls"][0] == 0
    assert tp4["allreduce_calls"][0] == 160
    # ring all-reduce: 2*(tp-1)/tp * bytes, two per layer, 8192*2 bytes per token
    assert tp4["allreduce_time_us"][0] == pytest.approx(2 * 0.75 * 2 * 80 * 8192 * 2 / 900e9 * 1e6)


def test_every_primitive_declares_a_unit_and_aggregates_are_supported():
    assert all(p.unit for p in PRIMITIVES)
    agg = supported_primitives(AGGREGATE_FEATURES)
    assert "attention_work" not in agg and "max_kv_tokens" not in agg
    assert {"weight_time_us", "kv_io_time_us", "matmul_time_us", "allreduce_calls"} <= set(agg)


def test_model_names_resolve_across_spellings():
    keys = {canonical_model_key(n) for n in ["meta-llama/Llama-2-70b-hf", "llama-2-70b", "Llama-2-70b-hf"]}
    assert len(keys) == 1
    assert canonical_model_key("mixtral-8x7b-v0-1") == canonical_model_key("Mixtral-8x7B-v0.1")
    assert canonical_model_key("codellama-34b") == canonical_model_key("codellama/CodeLlama-34b-Instruct-hf")


def test_a_model_named_without_its_version_is_the_one_model_it_can_be():
    # a trace names its model as the experiment's folder does, maybe without the version
    assert default_resolver().resolve("mixtral-8x7b", 2).model.name == "Mixtral-8x7B-v0.1"
    with pytest.raises(InputError, match="no config for model 'mixtral-8x7b-v0.2'"):
        default_resolver().resolve("mixtral-8x7b-v0.2", 2)  # another version is another model
    catalog = ModelCatalog.builtin()
    cfg, _ = catalog.configs[canonical_model_key("Mixtral-8x7B-v0.1")]
    catalog.add("Mixtral-8x7B-v0.2", cfg, "<a second version>")
    two = "no config for model 'mixtral-8x7b'; it could be Mixtral-8x7B-v0.1 or Mixtral-8x7B-v0.2: name the version"
    with pytest.raises(InputError, match=re.escape(two)):  # two it could be: neither, and it says so
        catalog.model("mixtral-8x7b")


def test_model_configs_dir_reads_the_real_configs(shared_data):
    r = DeploymentResolver.from_options(shared_data / "model_configs", shared_data / "hardware" / "h100-sxm.json")
    for name, tp in [("llama-2-70b", 4), ("codellama-34b", 2), ("mixtral-8x7b-v0-1", 2), ("llama-2-7b", 1)]:
        real = r.resolve(name, tp)
        builtin = default_resolver().resolve(name, tp)
        assert real.constants == pytest.approx(builtin.constants)


def test_unknown_architecture_is_a_one_line_input_error(tmp_path):
    cfg = {"architectures": ["MambaForCausalLM"], "hidden_size": 1}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="architectures.*unknown architecture"):
        ModelCatalog.from_dir(tmp_path).model("m")


def test_deployment_constants_are_the_sympy_formulas():
    """Deployment.constants evaluates primitives/deployment_formulas.py exactly; the
    ModelSpec properties (the emulator's) say the same about every built-in model."""
    import sympy as sp

    from primitives.deployment_formulas import (
        ACTIVE_MATMUL_PARAMS,
        CONSTANT_FORMULAS,
        KV_BYTES_PER_TOKEN,
        TOTAL_PARAMS,
        X,
    )

    for model in ("llama-2-7b", "llama-2-70b", "codellama-34b", "mixtral-8x7b-v0-1"):
        for tp in (1, 2, 4, 8):
            d = default_resolver().resolve(model, tp)
            subs = {X[k]: sp.nsimplify(v) for k, v in d.facts.items()}
            assert int(TOTAL_PARAMS.xreplace(subs)) == d.model.total_params
            assert float(ACTIVE_MATMUL_PARAMS.xreplace(subs)) == d.model.active_matmul_params
            assert int(KV_BYTES_PER_TOKEN.xreplace(subs)) == d.model.kv_bytes_per_token
            assert d.weight_bytes_per_gpu == d.model.total_params * d.model.dtype_bytes / tp
            assert d.constants == {k: float(e.xreplace(subs)) for k, e in CONSTANT_FORMULAS.items()}
