"""Go for the measured-kernel lookups (``primitives.kernels``): the deployment's tables
as package-level slices and one function per lookup, over the shared interpolation in
``templates/kernels.go.tmpl`` (the same arithmetic as ``Table1D``/``Table2D``).

Only the lookups an expression calls are embedded, for the one deployment exported.
"""

from __future__ import annotations

from primitives.deployment import Deployment
from primitives.kernels import LogGrid, Table1D, Table2D
from primitives.registry import KERNEL_ARITY
from translate_go.gosource import align_rows, render_template
from translate_go.printer import go_camel, go_float_literal

VALUES_PER_LINE = 6


def _grid_args(grid: LogGrid) -> str:
    return f"{go_float_literal(grid.start)}, {go_float_literal(grid.step)}"


def _slice(name: str, values: list[float]) -> list[str]:
    lines = [f"var {name} = []float64{{"]
    for i in range(0, len(values), VALUES_PER_LINE):
        lines.append("\t" + " ".join(f"{go_float_literal(v)}," for v in values[i : i + VALUES_PER_LINE]))
    lines.append("}")
    return lines


def kernels_source(deployment: Deployment, used: list[str]) -> str:
    """Tables, lookup functions and the interpolation helpers (empty when none is used)."""
    if not used:
        return ""
    tables = deployment.kernels.functions()
    m = deployment.model
    out: list[str] = []
    for name in sorted(used, key=list(KERNEL_ARITY).index):
        table, fn, data = tables[name], go_camel(name), go_camel(name) + "Log2"
        out.append(
            f"// {fn} is the measured-kernel lookup {name} of {m.name} at TP{deployment.tp} on "
            f"{deployment.gpu.name}\n// (primitives/kernels.py; log2 of µs on a log2 grid)."
        )
        if isinstance(table, Table1D):
            out += _slice(data, list(table.log2_us))
            out.append(
                f"\nfunc {fn}(x float64) float64 {{\n\treturn kernelLookup1D(x, {_grid_args(table.grid)}, {data})\n}}\n"
            )
        elif isinstance(table, Table2D):
            out += _slice(data, [v for row in table.log2_us for v in row])
            xg, yg = table.x_grid, table.y_grid
            grids = f"{_grid_args(xg)}, {xg.count}, {_grid_args(yg)}, {yg.count}"
            out.append(f"\nfunc {fn}(x, y float64) float64 {{\n\treturn kernelLookup2D(x, y, {grids}, {data})\n}}\n")
    out.append(render_template("kernels.go.tmpl"))
    return "\n".join(out)


def _shape_literal(deployment: Deployment) -> str:
    m = deployment.model
    experts = (m.n_experts, m.experts_per_tok) if m.is_moe else (1, 1)
    values = (m.n_layers, m.hidden_size, m.intermediate_size, m.n_heads, m.n_kv_heads, m.head_dim, *experts)
    return "kernelShape{" + ", ".join(str(v) for v in (*values, deployment.tp)) + "}"


def blis_kernels_source(deployments: list[Deployment], used: list[str]) -> str:
    """The lookups as methods of ``kernelTables``, one table set per embedded deployment,
    picked at construction by the model's shape and TP (``newKernelTables``)."""
    if not used:
        return ""
    used = sorted(used, key=list(KERNEL_ARITY).index)
    fields = {name: go_camel(name) + "Log2" for name in used}
    out = [
        "// kernelShape is what the measured-kernel tables depend on: the model's layers, hidden,",
        "// intermediate, heads, KV heads, head_dim, experts and experts per token (1, 1 dense), and TP.",
        "type kernelShape struct {",
        "\tlayers, hidden, intermediate, heads, kvHeads, headDim, experts, expertsPerTok, tp int",
        "}",
        "",
        "// kernelTables are one deployment's measured-kernel lookups (primitives/kernels.py; log2 of",
        "// µs on log2 grids).",
        "type kernelTables struct {",
        *align_rows([(f, "[]float64") for f in fields.values()]),
        "}",
        "",
    ]
    for name in used:
        sample = deployments[0].kernels.functions()[name]
        fn, data = go_camel(name), fields[name]
        out.append(f"// {fn} is the measured-kernel lookup {name}.")
        if isinstance(sample, Table1D):
            args, call = "x float64", f"kernelLookup1D(x, {_grid_args(sample.grid)}, k.{data})"
        else:
            xg, yg = sample.x_grid, sample.y_grid
            args = "x, y float64"
            call = f"kernelLookup2D(x, y, {_grid_args(xg)}, {xg.count}, {_grid_args(yg)}, {yg.count}, k.{data})"
        out.append(f"func (k *kernelTables) {fn}({args}) float64 {{\n\treturn {call}\n}}\n")
    names = ", ".join(f"{d.model.name} TP{d.tp}" for d in deployments)
    gpu = deployments[0].gpu
    out += [
        f"// kernelGPU is the GPU the tables were measured on ({gpu.name}).",
        f'const kernelGPU = "{_gpu_key(gpu.name)}"',
        "",
        f"// kernelTableSets holds the tables of the embedded deployments: {names}.",
        "var kernelTableSets = []struct {",
        "\tshape  kernelShape",
        "\ttables kernelTables",
        "}{",
    ]
    for d in deployments:
        tables = d.kernels.functions()
        out.append(f"\t{{ // {d.model.name} TP{d.tp}")
        out.append(f"\t\t{_shape_literal(d)},")
        out.append("\t\tkernelTables{")
        for name in used:
            table = tables[name]
            values = list(table.log2_us) if isinstance(table, Table1D) else [v for r in table.log2_us for v in r]
            body = _slice(fields[name], values)
            out.append(f"\t\t\t{fields[name]}: []float64{{")
            out += ["\t\t\t" + line for line in body[1:-1]]
            out.append("\t\t\t},")
        out.append("\t\t},")
        out.append("\t},")
    out.append("}")
    out.append("")
    out.append(render_template("blis_kernels.go.tmpl"))
    out.append(render_template("kernels.go.tmpl"))
    return "\n".join(out)


def _gpu_key(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum()).removesuffix("sxm")


__all__ = ["blis_kernels_source", "kernels_source"]
