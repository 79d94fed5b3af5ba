"""Go for the measured-kernel lookups (``primitives.kernels``): the deployment's tables
as package-level slices and one function per lookup, over the shared interpolation in
``templates/kernels.go.tmpl`` (the same arithmetic as ``Table1D``/``Table2D``).

Only the lookups an expression calls are embedded, for the one deployment exported.
"""

from __future__ import annotations

from primitives.deployment import Deployment
from primitives.kernels import LogGrid, Table1D, Table2D
from primitives.registry import KERNEL_ARITY
from translate_go.gosource import render_template
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


__all__ = ["kernels_source"]
