"""The two files of a BLIS backend: ``sim/latency/<name>_latency.go`` and its test.

Same expression code as the stand-alone export (``codegen``), but over BLIS's own
types (``*sim.Request``, ``sim.TokenID`` token slices), implementing
``sim.LatencyModel``, with the deployment constants (``blis_deployment``) and the
measured-kernel tables (``kernels.blis_kernels_source``) chosen at construction from
the ``sim.ModelHardwareConfig`` BLIS passes. Every package-level name is prefixed by the
backend's name (``prefix_identifiers``) so that several exports live side by side in
BLIS's package ``latency``.
"""

from __future__ import annotations

import re

import sympy as sp

from archive.entry import ArchiveEntry
from primitives.deployment import DEFAULT_GPU_MEMORY_UTILIZATION, GIB, KV_BLOCK_TOKENS, NON_KV_RESERVE_BYTES, Deployment
from translate_go.blis_deployment import deployment_constants_source, hardware_literal
from translate_go.golden import python_step_time_us, random_batches
from translate_go.golden_test_file import golden_test_source
from translate_go.gosource import join_sections, render_template
from translate_go.kernels import blis_kernels_source
from translate_go.model_file import client_methods_source, header_source, step_program
from translate_go.non_step import non_step_go_names, overheads_source
from translate_go.printer import go_camel, go_float_literal

BLIS_MODULE = "github.com/inference-sim/inference-sim"
BLIS_PACKAGE = "latency"  # sim/latency: where BLIS's backends and its factory live
DEPLOYMENT_GOLDEN_BATCHES = 40  # golden batches checked on each further deployment

_TOP_LEVEL = re.compile(r"^(?:func|type|var|const) ([A-Za-z_]\w*)|^\t([A-Za-z_]\w*)\s", re.M)
_BLOCK = re.compile(r"^(?:const|var) \($.*?^\)$", re.M | re.S)


def _imports(std: list[str]) -> str:
    lines = [f'\t"{n}"' for n in sorted(std)]
    return "import (\n" + "\n".join(lines) + f'\n\n\t"{BLIS_MODULE}/sim"\n)\n'


def blis_model_source(
    expr: sp.Expr,
    deployment: Deployment,
    kernel_deployments: list[Deployment],
    entry: ArchiveEntry,
    backend: str,
    overheads: dict[str, float],
    defaulted: list[str],
) -> str:
    """The backend's model file, before ``prefix_identifiers``."""
    decls, funcs = step_program(expr, deployment, method_of="Model")
    kernels = funcs.extra["kernels"]
    names = non_step_go_names()
    model = render_template(
        "blis_model.go.tmpl",
        kernel_field="\tk *kernelTables\n" if kernels else "",
        kernel_init=(
            "\tk, err := newKernelTables(hw)\n\tif err != nil {\n\t\treturn nil, err\n\t}\n" if kernels else ""
        ),
        kernel_arg=", k: k" if kernels else "",
        client_methods=client_methods_source("sim.Request"),
        gib_bytes=go_float_literal(float(GIB)),
        non_kv_reserve_bytes=go_float_literal(NON_KV_RESERVE_BYTES),
        **names,
    )
    std = ["fmt", "math"] + (["strings"] if kernels else [])
    return join_sections(
        [
            header_source(entry, deployment, BLIS_PACKAGE, "blis", defaulted, backend=backend),
            _imports(std),
            overheads_source(overheads),
            deployment_constants_source(deployment),
            decls,
            blis_kernels_source(kernel_deployments, kernels),
            funcs.text,
            model + "\n" + render_template("model_blis_methods.go.tmpl", **names),
            render_template("rounding.go.tmpl"),
        ]
    )


def _model_helpers(expr: sp.Expr, deployment: Deployment, others: list[Deployment], seed: int, backend: str) -> str:
    batches = random_batches(DEPLOYMENT_GOLDEN_BATCHES, seed)
    cases = []
    for d in others:
        want = python_step_time_us(expr, d, batches)
        values = ", ".join(go_float_literal(v) for v in want)
        kv_blocks = d.kv_capacity_blocks(DEFAULT_GPU_MEMORY_UTILIZATION)
        cases.append(
            f"\t{{\n\t\t{hardware_literal(d, indent=chr(9) * 2)},\n\t\t[]float64{{{values}}},\n\t\t{kv_blocks},\n\t}},"
        )
    return render_template(
        "blis_test_helpers.go.tmpl",
        golden_hardware=hardware_literal(deployment),
        golden_kv_blocks=deployment.kv_capacity_blocks(DEFAULT_GPU_MEMORY_UTILIZATION),
        kv_utilization=go_float_literal(DEFAULT_GPU_MEMORY_UTILIZATION),
        kv_block_tokens=KV_BLOCK_TOKENS,
        deployment_cases="\n".join(cases),
        backend=backend,
    )


def blis_test_source(
    expr: sp.Expr,
    deployment: Deployment,
    others: list[Deployment],
    backend: str,
    overheads: dict[str, float],
    n_golden: int,
    seed: int,
) -> str:
    """The backend's test file (golden vectors on DEPLOYMENT, a few on OTHERS), before prefixing."""
    return golden_test_source(
        expr,
        deployment,
        BLIS_PACKAGE,
        "blis",
        overheads,
        n_golden,
        seed,
        model_helpers=_model_helpers(expr, deployment, others, seed, backend),
        step_us="m.stepTimeUs",
        imports=_imports(["math", "testing"]),
    )


def go_prefix(backend: str) -> tuple[str, str]:
    """(unexported, exported) Go prefixes of a backend name: ``stepsynth`` -> (stepsynth, Stepsynth)."""
    lower = go_camel(backend)
    return lower, lower[:1].upper() + lower[1:]


def prefix_identifiers(sources: list[str], backend: str) -> list[str]:
    """Every package-level name of SOURCES prefixed by the backend's (tests: TestX -> TestNameX),
    and ``Request`` as ``sim.Request``; comments follow, so doc comments stay in step."""
    lower, upper = go_prefix(backend)
    names: set[str] = set()
    for src in sources:
        for m in _TOP_LEVEL.finditer(src):
            if m.group(1):
                names.add(m.group(1))
        for block in _BLOCK.finditer(src):
            names |= {m.group(2) for m in _TOP_LEVEL.finditer(block.group(0)) if m.group(2)}
    names.discard("_")

    def renamed(name: str) -> str:
        for test in ("Test", "Benchmark", "New"):
            if name.startswith(test) and name[len(test) :][:1].isupper():
                return test + upper + name[len(test) :]
        return upper + name if name[0].isupper() else lower + name[0].upper() + name[1:]

    mapping = {n: renamed(n) for n in names}
    mapping["Request"] = "sim.Request"
    # not a selector (x.Name), not a composite-literal key (Name: value)
    pattern = re.compile(
        r"(?<![\w.])(" + "|".join(sorted(map(re.escape, mapping), key=len, reverse=True)) + r")\b(?!\s*:[^=])"
    )
    return [pattern.sub(lambda m: mapping[m.group(1)], src) for src in sources]


__all__ = ["BLIS_MODULE", "BLIS_PACKAGE", "blis_model_source", "blis_test_source", "go_prefix", "prefix_identifiers"]
