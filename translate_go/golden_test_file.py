"""step_time_test.go: golden vectors computed by Python, rounding and overhead tests, a benchmark.

The test regenerates the golden batches in Go from the seed (``goldenBatch`` in
``templates/step_time_test.go.tmpl`` mirrors ``translate_go.golden.random_batches``:
SplitMix64 in counter form), so the file embeds only the seed, the shape limits and per
batch its size, checksum and Python's step time.
"""

from __future__ import annotations

import math

import numpy as np
import sympy as sp

from fitness.sim.latency_model import queueing_time_us
from primitives.deployment import Deployment
from translate_go.golden import (
    DRAWS_PER_REQUEST,
    HEADER_DRAWS,
    MAX_BATCH,
    MAX_MODEL_LEN,
    MAX_PREFILL_CHUNK,
    batch_checksum,
    draws_per_batch,
    python_step_time_us,
    random_batches,
    round_overhead_us,
    round_step_us,
)
from translate_go.gosource import align_rows, go_imports, render_template
from translate_go.non_step import non_step_go_names
from translate_go.printer import go_float_literal

QUEUE_TEST_INPUT_TOKENS = 1000  # prompt length the QueueingTime test case uses
# requests in the template's benchBatch (also the step before the load case): a fixed
# benchmark shape, the issue's 128-request batch, not the golden batches' limit
BENCH_BATCH_REQUESTS = 128
STANDALONE_MODEL_HELPER = """// goldenModel is the model under test (its constants are baked in).
func goldenModel(testing.TB) *Model { return NewModel() }
"""


def _queueing_us(overheads: dict[str, float], running: int) -> int:
    """QueueingTime Python expects for the test's prompt with RUNNING requests in the last step,
    before the Go model adds that step's time (the output delay: ``model.go.tmpl``)."""
    queue_us = queueing_time_us(
        overheads["queueing_base_us"],
        overheads["queueing_per_input_token_us"],
        QUEUE_TEST_INPUT_TOKENS,
        overheads["queueing_per_running_request_us"],
        running,
    )
    return round_overhead_us(float(queue_us))


def _method_rows(interface: str, overheads: dict[str, float], queue_idle_us: int) -> str:
    """The TestOverheads cases: each non-step method and the value Python expects
    (QueueingTime: QUEUE_IDLE_US, since a fresh model has priced no step yet)."""
    expected = [
        (f"QueueingTime(&Request{{InputTokens: goldenTokens[:{QUEUE_TEST_INPUT_TOKENS}]}})", queue_idle_us),
        ("OutputTokenProcessingTime()", round_overhead_us(overheads["output_token_processing_us"])),
    ]
    if interface == "seed":
        expected += [
            ("SchedulingProcessingTime()", round_overhead_us(overheads["scheduling_processing_us"])),
            ("PreemptionProcessingTime()", round_overhead_us(overheads["preemption_processing_us"])),
        ]
    else:
        expected += [("PostDecodeFixedOverhead()", round_overhead_us(overheads["post_decode_fixed_us"]))]
    return "\n".join(f'\t\t{{"{call.split("(")[0]}", m.{call}, {want}}},' for call, want in expected)


def _golden_consts(seed: int) -> list[str]:
    return align_rows(
        [
            ("goldenSeed", "uint64", f"= {int(seed) & ((1 << 64) - 1)}", "// translate_go.golden.random_batches seed"),
            ("goldenMaxBatch", "uint64", f"= {MAX_BATCH}", "// requests per batch: 1 .. max_num_seqs"),
            ("goldenMaxModelLen", "uint64", f"= {MAX_MODEL_LEN}", "// max_model_len: prompt + output KV limit"),
            ("goldenMaxPrefillChunk", "uint64", f"= {MAX_PREFILL_CHUNK}", "// max_num_batched_tokens"),
            ("goldenHeaderDraws", "uint64", f"= {HEADER_DRAWS}", "// draws per batch before the requests"),
            ("goldenDrawsPerRequest", "uint64", f"= {DRAWS_PER_REQUEST}", "// draws per request"),
            ("goldenDrawsPerBatch", "uint64", f"= {draws_per_batch(MAX_BATCH)}", "// header + max batch requests"),
        ]
    )


def golden_test_source(
    expr: sp.Expr,
    deployment: Deployment,
    package: str,
    interface: str,
    overheads: dict[str, float],
    n_golden: int,
    seed: int,
    *,
    model_helpers: str = STANDALONE_MODEL_HELPER,
    step_us: str = "stepTimeUs",
    imports: tuple[str, ...] | str = ("math", "testing"),
) -> str:
    """The text of step_time_test.go: golden vectors from Python, overheads, benchmark.

    MODEL_HELPERS defines ``goldenModel(testing.TB)`` (and anything else the caller's
    tests need); STEP_US is the unrounded step-time function of ``m``; IMPORTS the
    package names or the import declaration itself.
    """
    batches = random_batches(n_golden, seed)
    want_us = python_step_time_us(expr, deployment, batches)
    empty_us = float(python_step_time_us(expr, deployment, [np.zeros((0, 4), dtype=np.int64)])[0])
    fold = overheads["scheduling_processing_us"] if interface == "blis" else 0.0
    queue_idle_us = _queueing_us(overheads, 0)
    rows = [
        f"\t{{{len(b)}, {batch_checksum(b)}, {go_float_literal(us)}, {round_step_us(float(us) + fold)}}},"
        for b, us in zip(batches, want_us, strict=True)
    ]
    return render_template(
        "step_time_test.go.tmpl",
        package=package,
        imports=imports if isinstance(imports, str) else go_imports(list(imports)),
        model_helpers=model_helpers,
        step_us=step_us,
        n_golden=n_golden,
        max_batch=MAX_BATCH,
        max_model_len=MAX_MODEL_LEN,
        golden_consts="\n".join(_golden_consts(seed)),
        golden_rows="\n".join(rows),
        fold_doc=(
            "the scheduling overhead: BLIS has no SchedulingProcessingTime"
            if interface == "blis"
            else "nothing in the seed interface"
        ),
        fold_go=non_step_go_names()["scheduling_processing_us"] if interface == "blis" else "0",
        empty_batch_us=go_float_literal(empty_us) if math.isfinite(empty_us) else "0.0",
        empty_batch_finite="true" if math.isfinite(empty_us) else "false",
        method_rows=_method_rows(interface, overheads, queue_idle_us),
        queue_input_tokens=QUEUE_TEST_INPUT_TOKENS,
        queue_after_batch_us=_queueing_us(overheads, BENCH_BATCH_REQUESTS),
        queue_idle_us=queue_idle_us,
        bench_batch_requests=BENCH_BATCH_REQUESTS,
    )


__all__ = ["golden_test_source"]
