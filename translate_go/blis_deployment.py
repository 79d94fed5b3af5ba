"""Go that computes the deployment constants inside BLIS, from ``sim.ModelHardwareConfig``.

BLIS hands every backend the model's ``config.json`` facts (``sim.ModelConfig``), the
GPU's datasheet (``sim.HardwareCalib``) and the TP degree. ``FACT_GO`` says where each
fact of ``primitives.deployment_formulas`` lives there; the constants themselves are
printed from the formulas' sympy expressions (never written by hand), so the backend
serves every model, TP and GPU a BLIS user names.

Two facts are not in BLIS's structs and are documented in the generated file:
``tie_word_embeddings`` (0: untied, as every model in the data) and the NVLink
bandwidth (the datasheet the export read).
"""

from __future__ import annotations

from primitives.deployment import GIB, Deployment
from primitives.deployment_formulas import CONSTANT_FORMULAS, FACT_UNITS, X
from primitives.registry import CONSTANT_UNITS
from translate_go.codegen import CONSTANT_GO_NAMES, format_statement
from translate_go.gosource import align_rows
from translate_go.printer import GoCodePrinter, NameAllocator, go_camel, go_float_literal, lower_statements

# fact -> Go expression over mc (sim.ModelConfig), gpu (sim.HardwareCalib), hw and the
# locals kvHeadCount, expertCount, topKCount set by the constructor's preamble.
FACT_GO = {
    "hidden_size": "float64(mc.HiddenDim)",
    "intermediate_size": "float64(mc.IntermediateDim)",
    "n_layers": "float64(mc.NumLayers)",
    "n_heads": "float64(mc.NumHeads)",
    "n_kv_heads": "float64(kvHeadCount)",
    "head_dim": "float64(mc.EffectiveHeadDim())",
    "vocab_size": "float64(mc.VocabSize)",
    "n_experts": "float64(expertCount)",
    "experts_per_tok": "float64(topKCount)",
    "dtype_bytes": "mc.BytesPerParam",
    "tied_embeddings": "0.0",
    "dense_flops_per_s": "gpu.TFlopsPeak * 1e12",
    "hbm_bytes_per_s": "gpu.BwPeakTBs * 1e12",
    "nvlink_bytes_per_s": "datasheetNVLinkBytesPerS",
    "tp_degree": "float64(hw.TP)",
}
assert set(FACT_GO) == set(FACT_UNITS)
FACT_LOCALS = {name: go_camel(name) for name in FACT_UNITS}
# (what BLIS calls it, Go value): each must be positive for the physics to mean anything
REQUIRED_POSITIVE = (
    ("num_hidden_layers", "float64(mc.NumLayers)"),
    ("hidden_size", "float64(mc.HiddenDim)"),
    ("intermediate_size", "float64(mc.IntermediateDim)"),
    ("num_attention_heads", "float64(mc.NumHeads)"),
    ("num_key_value_heads", "float64(kvHeadCount)"),
    ("head_dim", "float64(mc.EffectiveHeadDim())"),
    ("vocab_size", "float64(mc.VocabSize)"),
    ("bytes_per_param", "mc.BytesPerParam"),
    ("TFlopsPeak", "gpu.TFlopsPeak"),
    ("BwPeakTBs", "gpu.BwPeakTBs"),
    ("TP", "float64(hw.TP)"),
)

_PREAMBLE = """\tmc, gpu := hw.ModelConfig, hw.HWConfig
\tkvHeadCount := mc.NumKVHeads
\tif kvHeadCount == 0 { // absent from config.json: plain multi-head attention
\t\tkvHeadCount = mc.NumHeads
\t}
\texpertCount, topKCount := 1, 1 // dense, as BLIS's IsMoE says
\tif mc.IsMoE() {
\t\texpertCount, topKCount = mc.NumLocalExperts, max(mc.NumExpertsPerTok, 1)
\t}
"""


def deployment_constants_source(deployment: Deployment) -> str:
    """The constants struct, the NVLink figure and ``newDeploymentConstants(hw)``."""
    rows = [(CONSTANT_GO_NAMES[c], "float64", f"// {CONSTANT_UNITS[c]} ({c})") for c in CONSTANT_UNITS]
    lines = [
        "// deploymentConstants are the primitives' deployment constants, computed at construction",
        "// from what BLIS names (primitives/deployment_formulas.py, printed from its sympy).",
        "type deploymentConstants struct {",
        *align_rows(rows),
        "}",
        "",
        f"// datasheetNVLinkBytesPerS is the NVLink bandwidth of the {deployment.gpu.name} datasheet the export read:",
        "// BLIS's hardware_config.json has no interconnect figure, so every GPU gets this one.",
        f"const datasheetNVLinkBytesPerS = {go_float_literal(deployment.gpu.nvlink_bytes_per_s)}",
        "",
        "// newDeploymentConstants computes the constants from the model's config.json facts, the",
        "// GPU datasheet and the TP degree BLIS hands every backend. sim.ModelConfig carries no",
        "// tie_word_embeddings, so embeddings count as untied (true of every model in the data).",
        "func newDeploymentConstants(hw sim.ModelHardwareConfig) (deploymentConstants, error) {",
        _PREAMBLE.rstrip("\n"),
        "\tfor _, fact := range []struct {",
        "\t\tname  string",
        "\t\tvalue float64",
        "\t}{",
        *[f'\t\t{{"{name}", {value}}},' for name, value in REQUIRED_POSITIVE],
        "\t} {",
        "\t\tif !(fact.value > 0) || math.IsInf(fact.value, 0) {",
        '\t\t\treturn deploymentConstants{}, fmt.Errorf("latency model: %s must be positive and finite, got %v", '
        "fact.name, fact.value)",
        "\t\t}",
        "\t}",
    ]
    lines += [f"\t{FACT_LOCALS[name]} := {FACT_GO[name]}" for name in FACT_UNITS if _used(name)]
    alloc = NameAllocator()
    alloc.taken |= set(FACT_LOCALS.values()) | {"mc", "gpu", "hw", "c", "fact", "kvHeadCount", "expertCount"}
    alloc.taken |= {"topKCount"}
    printer = GoCodePrinter(names={X[name].name: FACT_LOCALS[name] for name in FACT_UNITS})
    lines.append("\tvar c deploymentConstants")
    for name, expr in CONSTANT_FORMULAS.items():
        stmts, value = lower_statements(expr, printer, alloc, use_cse=False)
        lines += [format_statement("\t" + s) for s in stmts]
        lines.append(format_statement(f"\tc.{CONSTANT_GO_NAMES[name]} = {value}"))
    lines += ["\treturn c, nil", "}"]
    return "\n".join(lines) + "\n"


def _used(fact: str) -> bool:
    return any(X[fact] in expr.free_symbols for expr in CONSTANT_FORMULAS.values())


def hardware_literal(deployment: Deployment, indent: str = "\t") -> str:
    """A ``sim.ModelHardwareConfig`` literal of a Python deployment (for the golden tests)."""
    m, g = deployment.model, deployment.gpu
    model_fields = [
        ("NumLayers", m.n_layers),
        ("HiddenDim", m.hidden_size),
        ("NumHeads", m.n_heads),
        ("NumKVHeads", m.n_kv_heads),
        ("VocabSize", m.vocab_size),
        ("BytesPerParam", go_float_literal(m.dtype_bytes)),
        ("IntermediateDim", m.intermediate_size),
        ("NumLocalExperts", m.n_experts if m.is_moe else 0),
        ("NumExpertsPerTok", m.experts_per_tok if m.is_moe else 0),
        ("HeadDim", m.head_dim),
    ]
    hw_fields = [
        ("TFlopsPeak", go_float_literal(g.dense_flops_per_s / 1e12)),
        ("BwPeakTBs", go_float_literal(g.hbm_bytes_per_s / 1e12)),
        ("MemoryGiB", go_float_literal(g.memory_bytes / GIB)),
    ]
    inner = indent + "\t"
    model = ", ".join(f"{k}: {v}" for k, v in model_fields)
    calib = ", ".join(f"{k}: {v}" for k, v in hw_fields)
    return (
        "sim.ModelHardwareConfig{\n"
        f"{inner}ModelConfig: sim.ModelConfig{{{model}}},\n"
        f"{inner}HWConfig:    sim.HardwareCalib{{{calib}}},\n"
        f'{inner}Model:       "{m.name}",\n'
        f'{inner}GPU:         "{g.name}",\n'
        f"{inner}TP:          {deployment.tp},\n"
        f"{indent}}}"
    )


__all__ = ["FACT_GO", "deployment_constants_source", "hardware_literal"]
