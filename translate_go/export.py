"""``export_go``: an archived step-time expression -> a Go package for BLIS.

Writes ``step_time.go`` (the model), ``step_time_test.go`` (golden vectors computed by
Python, a rounding/overhead test, ``BenchmarkStepTime`` on a 128-request batch) and a
``go.mod`` when the directory has none. The output is gofmt-clean by construction
(``translate_go.goformat``) and needs nothing beyond the Go standard library.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import sympy as sp

from archive.entry import ArchiveEntry
from primitives.deployment import Deployment, DeploymentResolver
from primitives.errors import InputError

from .codegen import program_sources
from .goformat import format_go_expr
from .golden import (
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
from .printer import GoPrintError, go_float_literal

INTERFACES = ("seed", "blis")
GO_VERSION = "1.21"
OVERHEAD_KEYS = (
    "queueing_base_us",
    "queueing_per_input_token_us",
    "output_token_processing_us",
    "scheduling_processing_us",
    "preemption_processing_us",
    "post_decode_fixed_us",
)
OVERHEAD_GO_NAMES = {
    "queueing_base_us": "queueingBaseUs",
    "queueing_per_input_token_us": "queueingPerInputTokenUs",
    "output_token_processing_us": "outputTokenProcessingUs",
    "scheduling_processing_us": "schedulingProcessingUs",
    "preemption_processing_us": "preemptionProcessingUs",
    "post_decode_fixed_us": "postDecodeFixedUs",
}
OVERHEAD_DOCS = {
    "queueing_base_us": "QueueingTime: arrival -> enqueued, fixed part",
    "queueing_per_input_token_us": "QueueingTime: per prompt token (tokenisation)",
    "output_token_processing_us": "OutputTokenProcessingTime: token emitted -> client event",
    "scheduling_processing_us": "SchedulingProcessingTime: added to every step",
    "preemption_processing_us": "PreemptionProcessingTime: per preemption",
    "post_decode_fixed_us": "PostDecodeFixedOverhead: after a request's last token",
}
_GO_IDENT = re.compile(r"^[a-z][a-z0-9_]*$")
_DOC_MARKER = re.compile(r"^([-*+\u2022]|\d+[.)]|#)(\s|$)")

# The fields of BLIS's sim.Request the model reads, with BLIS's names and types.
REQUEST_GO = """// Request carries the fields of BLIS's sim.Request that the model reads (same names
// and types). To use BLIS's own type instead, delete this struct and declare
//
//	type Request = sim.Request
//
// with the import "github.com/inference-sim/inference-sim/sim".
type Request struct {
	ProgressIndex int64 // prompt+output tokens already in the KV cache
	NumNewTokens  int   // tokens this step computes for the request
	InputTokens   []int // prompt tokens; only the length is read
	OutputTokens  []int // tokens generated so far; only the length is read
}
"""

ROUNDING_GO = """// roundAtLeast turns µs into BLIS's int64 µs: math.Round (half away from zero), at
// least floor; NaN gives floor and values beyond int64 saturate.
func roundAtLeast(us float64, floor int64) int64 {
	if !(us >= float64(floor)) {
		return floor
	}
	if us >= math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(math.Round(us))
}

// roundStepUs rounds a step time: BLIS's StepTime is at least 1 µs.
func roundStepUs(us float64) int64 { return roundAtLeast(us, 1) }

// roundOverheadUs rounds a non-step term, at least 0 µs.
func roundOverheadUs(us float64) int64 { return roundAtLeast(us, 0) }
"""

# Mirror of translate_go.golden.random_batches (SplitMix64 in counter form).
GOLDEN_GENERATOR_GO = """// goldenDraw is draw k of a counter-form SplitMix64 seeded with seed.
func goldenDraw(seed, k uint64) uint64 {
	z := seed + (k+1)*0x9E3779B97F4A7C15
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}

// goldenBatch regenerates batch b exactly as translate_go/golden.py random_batches
// does; every request slices the shared tokens array (only lengths are read).
func goldenBatch(b int, tokens []int) []*Request {
	base := uint64(b) * goldenDrawsPerBatch
	n := 1 + int(goldenDraw(goldenSeed, base)%goldenMaxBatch)
	share := goldenDraw(goldenSeed, base+2) % 1001 // per mille of prefill requests
	switch goldenDraw(goldenSeed, base+1) % 3 {
	case 0:
		share = 0
	case 1:
		share = 1000
	}
	batch := make([]*Request, n)
	for j := range batch {
		k := base + goldenHeaderDraws + uint64(j)*goldenDrawsPerRequest
		inputLen := 1 + goldenDraw(goldenSeed, k+1)%(goldenMaxModelLen-1)
		r := &Request{InputTokens: tokens[:inputLen]}
		if goldenDraw(goldenSeed, k)%1000 < share { // prefill chunk
			progress := goldenDraw(goldenSeed, k+2) % inputLen
			room := inputLen - progress
			if room > goldenMaxPrefillChunk {
				room = goldenMaxPrefillChunk
			}
			r.ProgressIndex = int64(progress)
			r.NumNewTokens = int(1 + goldenDraw(goldenSeed, k+3)%room)
			r.OutputTokens = tokens[:0]
		} else { // decode
			outputLen := 1 + goldenDraw(goldenSeed, k+2)%(goldenMaxModelLen-inputLen)
			r.ProgressIndex = int64(inputLen + outputLen - 1)
			r.NumNewTokens = 1
			r.OutputTokens = tokens[:outputLen]
		}
		batch[j] = r
	}
	return batch
}

// batchChecksum is the sum of every field of every request (as golden.py's batch_checksum).
func batchChecksum(batch []*Request) int64 {
	var sum int64
	for _, r := range batch {
		sum += r.ProgressIndex + int64(r.NumNewTokens) + int64(len(r.InputTokens)) + int64(len(r.OutputTokens))
	}
	return sum
}
"""


def align_rows(rows: Sequence[Sequence[str]], indent: str = "\t") -> list[str]:
    """Columns padded as gofmt's tabwriter pads them (one space minimum, last cell free)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths)] + [r[-1]]
        out.append((indent + " ".join(cells)).rstrip())
    return out


def _imports(names: list[str]) -> str:
    names = sorted(set(names))
    if not names:
        return ""
    if len(names) == 1:
        return f'import "{names[0]}"\n'
    return "import (\n" + "".join(f'\t"{n}"\n' for n in names) + ")\n"


def parse_entry_expression(entry: ArchiveEntry) -> sp.Expr:
    """The entry's expression as sympy (primitives.language.parse_infix)."""
    from primitives.language import parse_infix

    try:
        return parse_infix(entry.expression)
    except Exception as exc:  # sympy raises many kinds; report one line
        raise InputError(f"archive entry {entry.id}", "expression", f"cannot parse {entry.expression!r} ({exc})") from None


def resolve_overheads(entry: ArchiveEntry) -> tuple[dict[str, float], list[str]]:
    """All six overheads (µs) and the keys that fell back to BLIS's default 0."""
    given = dict(entry.overheads or {})
    unknown = sorted(set(given) - set(OVERHEAD_KEYS))
    if unknown:
        raise InputError(
            f"archive entry {entry.id}", "overheads", f"unknown keys {unknown}; expected some of {list(OVERHEAD_KEYS)}"
        )
    out, defaulted = {}, []
    for key in OVERHEAD_KEYS:
        if key in given:
            value = given[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
                raise InputError(f"archive entry {entry.id}", f"overheads.{key}", f"expected a finite number of µs, got {value!r}")
            out[key] = float(value)
        else:
            out[key] = 0.0
            defaulted.append(key)
    return out, defaulted


def _comment_lines(text: str, width: int = 88) -> list[str]:
    """Wrap plain prose for a // comment (no leading '-', '#' or digits: gofmt doc rules)."""
    words, lines, cur = text.split(), [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    if cur:
        lines.append(cur)
    # gofmt reads a comment line starting "- ", "1. ", "2) " or "# " as a list item or
    # heading and reformats it; keep such words at the end of the previous line.
    i = 1
    while i < len(lines):
        if _DOC_MARKER.match(lines[i]):
            first, _, rest = lines[i].partition(" ")
            lines[i - 1] += " " + first
            if rest:
                lines[i] = rest
            else:
                del lines[i]
            continue
        i += 1
    if lines and _DOC_MARKER.match(lines[0]):
        lines[0] = "Note: " + lines[0]
    return lines


def _fmt_objective(v) -> str:
    try:
        return f"{float(v):.4g}"
    except (TypeError, ValueError):
        return str(v)


def _header(entry: ArchiveEntry, deployment: Deployment, package: str, interface: str, defaulted: list[str]) -> str:
    objectives = ", ".join(f"{k}={_fmt_objective(v)}" for k, v in sorted((entry.objectives or {}).items()))
    m = deployment.model
    prose = []
    prose.append(
        f"Package {package} is an evolved vLLM step-time model for the BLIS simulator; Model implements "
        + (
            "the seed LatencyModel interface (StepTime, QueueingTime, OutputTokenProcessingTime, "
            "SchedulingProcessingTime, PreemptionProcessingTime)."
            if interface == "seed"
            else "BLIS's LatencyModel interface (StepTime, QueueingTime, OutputTokenProcessingTime, "
            "PostDecodeFixedOverhead). BLIS has no SchedulingProcessingTime, so the scheduling "
            "overhead is folded into StepTime."
        )
    )
    paras = [prose[0], "Step time in µs, from the archived expression:"]
    facts = [
        f"Errors: {objectives or 'not recorded in the archive entry'}.",
        f"Archive entry: {entry.id or 'unnamed'} (run {entry.run_id or 'unknown'}, generation {entry.generation}, "
        f"seed {entry.seed}, complexity {entry.complexity}).",
        f"Data fingerprint: {entry.dataset_fingerprint or 'not recorded'}.",
        f"Deployment: {m.name} at TP{deployment.tp} on {deployment.gpu.name}; the deployment constants are "
        "embedded below, so regenerate the package for another deployment.",
    ]
    if len(defaulted) == len(OVERHEAD_KEYS):
        facts.append(
            "Overheads: the archive entry carries none, so every non-step term is BLIS's default 0 µs."
        )
    elif defaulted:
        facts.append(f"Overheads: from the archive entry; {', '.join(defaulted)} not recorded, so BLIS's default 0 µs.")
    else:
        facts.append("Overheads: as stored with the archive entry (fitted, or 0 where the data cannot fit them).")
    if interface == "seed":
        facts.append("post_decode_fixed_us is kept as a constant but unused: the seed interface has no such method.")
    facts.append(
        "Rounding: StepTime returns max(1, math.Round(µs)) (NaN gives 1); the other methods math.Round, at least 0. "
        "The unrounded step time is stepTimeUs(batch)."
    )
    lines = [
        f"// Code generated by stepsynth translate_go from archive entry {entry.id or 'unnamed'}. DO NOT EDIT.",
        "",
    ]
    lines += [f"// {line}" for line in _comment_lines(paras[0])]
    lines += ["//"]
    lines += [f"// {line}" for line in _comment_lines(paras[1])]
    lines += ["//"]
    readable = " ".join((entry.expression or "").split())
    lines += [f"//\t{readable}"]
    for fact in facts:
        lines += ["//"]
        lines += [f"// {line}" for line in _comment_lines(fact)]
    lines.append(f"package {package}")
    return "\n".join(lines) + "\n"


def _overheads_source(overheads: dict[str, float]) -> str:
    rows = [
        (OVERHEAD_GO_NAMES[k], "float64", f"= {go_float_literal(overheads[k])}", f"// {OVERHEAD_DOCS[k]}")
        for k in OVERHEAD_KEYS
    ]
    lines = ["// Non-step latency terms, µs (archive entry overheads; see fitness/latency.py)."]
    lines.append("const (")
    lines += align_rows(rows)
    lines.append(")")
    return "\n".join(lines) + "\n"


def _model_source(interface: str) -> str:
    if interface == "seed":
        methods = [
            ("StepTime(batch []*Request) int64", None),
            ("QueueingTime(req *Request) int64", None),
            ("OutputTokenProcessingTime() int64", None),
            ("SchedulingProcessingTime() int64", None),
            ("PreemptionProcessingTime() int64", None),
        ]
    else:
        methods = [
            ("StepTime(batch []*Request) int64", None),
            ("QueueingTime(req *Request) int64", None),
            ("OutputTokenProcessingTime() int64", None),
            ("PostDecodeFixedOverhead() int64", None),
        ]
    iface = "\n".join(f"\t{sig}" for sig, _ in methods)
    step_doc = (
        "// StepTime is the batch's step time in µs (BLIS's StepTime), rounded by roundStepUs."
        if interface == "seed"
        else "// StepTime is the batch's step time in µs (BLIS's StepTime), rounded by roundStepUs.\n"
        "// It includes the scheduling overhead: BLIS has no SchedulingProcessingTime method."
    )
    step_expr = "stepTimeUs(batch)" if interface == "seed" else format_go_expr("stepTimeUs(batch) + schedulingProcessingUs")
    parts = [
        f"""// LatencyModel mirrors the {"seed" if interface == "seed" else "BLIS"} latency-model interface. With BLIS's own types,
// delete it (and Request) and assert var _ sim.LatencyModel = (*Model)(nil) instead.
type LatencyModel interface {{
{iface}
}}

var _ LatencyModel = (*Model)(nil)

// Model is the evolved latency model; the zero value is ready to use.
type Model struct{{}}

// NewModel returns a Model.
func NewModel() *Model {{
	return &Model{{}}
}}

{step_doc}
func (m *Model) StepTime(batch []*Request) int64 {{
	return roundStepUs({step_expr})
}}

// QueueingTime is the time from arrival to the scheduler's queue, µs.
func (m *Model) QueueingTime(req *Request) int64 {{
	return roundOverheadUs({format_go_expr("queueingBaseUs + queueingPerInputTokenUs*float64(len(req.InputTokens))")})
}}

// OutputTokenProcessingTime is the delay from an emitted token to the client, µs.
func (m *Model) OutputTokenProcessingTime() int64 {{
	return roundOverheadUs(outputTokenProcessingUs)
}}
"""
    ]
    if interface == "seed":
        parts.append(
            """
// SchedulingProcessingTime is the scheduler's overhead added to every step, µs.
func (m *Model) SchedulingProcessingTime() int64 {
	return roundOverheadUs(schedulingProcessingUs)
}

// PreemptionProcessingTime is the overhead of one preemption, µs.
func (m *Model) PreemptionProcessingTime() int64 {
	return roundOverheadUs(preemptionProcessingUs)
}
"""
        )
    else:
        parts.append(
            """
// PostDecodeFixedOverhead is the fixed time after a request's last token, µs.
func (m *Model) PostDecodeFixedOverhead() int64 {
	return roundOverheadUs(postDecodeFixedUs)
}
"""
        )
    return "".join(parts)


def model_file_source(
    expr: sp.Expr,
    deployment: Deployment,
    entry: ArchiveEntry,
    package: str,
    interface: str,
    overheads: dict[str, float],
    defaulted: list[str],
) -> str:
    """The text of step_time.go."""
    decls, funcs = program_sources(
        [expr],
        deployment,
        ["stepTimeUs"],
        [["stepTimeUs is the step time of the batch in µs, before rounding."]],
    )
    sections = [
        _header(entry, deployment, package, interface, defaulted),
        _imports(["math"]),  # roundStepUs always needs math
        REQUEST_GO,
        _overheads_source(overheads),
        decls,
        funcs.text,
        _model_source(interface),
        ROUNDING_GO,
    ]
    return "\n".join(s.rstrip("\n") + "\n" for s in sections if s)


def _float_go(x: float) -> str:
    return go_float_literal(x)


def golden_test_source(
    expr: sp.Expr,
    deployment: Deployment,
    package: str,
    interface: str,
    overheads: dict[str, float],
    n_golden: int,
    seed: int,
) -> str:
    """The text of step_time_test.go: golden vectors from Python, overheads, benchmark."""
    batches = random_batches(n_golden, seed)
    want_us = python_step_time_us(expr, deployment, batches)
    empty_us = float(python_step_time_us(expr, deployment, [np.zeros((0, 4), dtype=np.int64)])[0])
    fold = overheads["scheduling_processing_us"] if interface == "blis" else 0.0
    rows = []
    for b, us in zip(batches, want_us):
        rows.append(
            f"\t{{{len(b)}, {batch_checksum(b)}, {_float_go(us)}, {round_step_us(float(us) + fold)}}},"
        )
    queue_len = 1000
    expected_methods = [
        ("QueueingTime(&Request{InputTokens: make([]int, 1000)})",
         round_overhead_us(overheads["queueing_base_us"] + overheads["queueing_per_input_token_us"] * queue_len)),
        ("OutputTokenProcessingTime()", round_overhead_us(overheads["output_token_processing_us"])),
    ]
    if interface == "seed":
        expected_methods += [
            ("SchedulingProcessingTime()", round_overhead_us(overheads["scheduling_processing_us"])),
            ("PreemptionProcessingTime()", round_overhead_us(overheads["preemption_processing_us"])),
        ]
    else:
        expected_methods += [("PostDecodeFixedOverhead()", round_overhead_us(overheads["post_decode_fixed_us"]))]
    method_rows = "\n".join(f'\t\t{{"{call.split("(")[0]}", m.{call}, {want}}},' for call, want in expected_methods)
    golden_consts = align_rows(
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
    fold_go = "schedulingProcessingUs" if interface == "blis" else "0"
    imports = _imports(["math", "testing"])
    text = f"""// Code generated by stepsynth translate_go. DO NOT EDIT.

package {package}

{imports}
// Golden vectors: {n_golden} random batches (1 .. {MAX_BATCH} requests, prefill and decode mixed, KV up to
// {MAX_MODEL_LEN} tokens) that Go regenerates from the seed as translate_go/golden.py does,
// with the step times Python computed for them (primitives.compute +
// primitives.language.evaluate_expr).
const (
{chr(10).join(golden_consts)}
)

// goldenCase is one batch: its size and checksum (to prove it was regenerated
// exactly), Python's unrounded step time and the StepTime Python expects.
type goldenCase struct {{
	n    int
	sum  int64
	us   float64
	step int64
}}

var goldenCases = []goldenCase{{
{chr(10).join(rows)}
}}

// stepFoldUs is what StepTime adds to stepTimeUs ({"the scheduling overhead: BLIS has no SchedulingProcessingTime" if interface == "blis" else "nothing in the seed interface"}).
const stepFoldUs = {fold_go}

// emptyBatchUs is Python's step time of an empty batch.
const emptyBatchUs = {_float_go(empty_us) if math.isfinite(empty_us) else "0.0"}

const emptyBatchFinite = {"true" if math.isfinite(empty_us) else "false"}

// closeUs accepts 1 µs of difference (or 1e-9 relative for huge values); NaN
// matches NaN and infinities match themselves.
func closeUs(got, want float64) bool {{
	if math.IsNaN(want) || math.IsInf(want, 0) {{
		return math.IsNaN(got) && math.IsNaN(want) || got == want
	}}
	return math.Abs(got-want) <= math.Max(1, 1e-9*math.Abs(want))
}}

func TestGoldenStepTimes(t *testing.T) {{
	m := NewModel()
	tokens := make([]int, goldenMaxModelLen)
	maxAbs, maxRel := 0.0, 0.0 // largest |Go - Python| over the finite cases, µs and relative
	for b, want := range goldenCases {{
		batch := goldenBatch(b, tokens)
		if len(batch) != want.n || batchChecksum(batch) != want.sum {{
			t.Fatalf("batch %d: regenerated n=%d checksum=%d, Python had n=%d checksum=%d",
				b, len(batch), batchChecksum(batch), want.n, want.sum)
		}}
		got := stepTimeUs(batch)
		if !closeUs(got, want.us) {{
			t.Errorf("batch %d: stepTimeUs = %.17g, Python %.17g", b, got, want.us)
		}}
		if d := math.Abs(got - want.us); d > maxAbs {{ // NaN (non-finite cases) never compares greater
			maxAbs = d
		}}
		if d := math.Abs(got-want.us) / math.Abs(want.us); d > maxRel {{
			maxRel = d
		}}
		step := m.StepTime(batch)
		if step != roundStepUs(got+stepFoldUs) {{
			t.Errorf("batch %d: StepTime = %d, not the rounded step time %.17g", b, step, got)
		}}
		// Exact unless Python's value sits on a .5 boundary that float noise may cross.
		x := want.us + stepFoldUs
		onHalf := math.Abs(x-math.Floor(x)-0.5) < 1e-6 && (step-want.step == 1 || want.step-step == 1)
		if step != want.step && !onHalf {{
			t.Errorf("batch %d: StepTime = %d, Python expects %d", b, step, want.step)
		}}
	}}
	t.Logf("max |Go - Python| over %d golden batches: %.3g µs (relative %.3g)", len(goldenCases), maxAbs, maxRel)
}}

func TestEmptyBatch(t *testing.T) {{
	if got := NewModel().StepTime(nil); got < 1 {{
		t.Errorf("StepTime(nil) = %d, want at least 1", got)
	}}
	if got := stepTimeUs(nil); emptyBatchFinite && !closeUs(got, emptyBatchUs) {{
		t.Errorf("stepTimeUs(nil) = %.17g, Python %.17g", got, emptyBatchUs)
	}}
}}

func TestRounding(t *testing.T) {{
	cases := []struct {{
		us   float64
		want int64
	}}{{
		{{math.NaN(), 1}}, {{-5, 1}}, {{0.2, 1}}, {{1.49, 1}}, {{1.5, 2}}, {{2.5, 3}}, {{1e30, math.MaxInt64}},
	}}
	for _, c := range cases {{
		if got := roundStepUs(c.us); got != c.want {{
			t.Errorf("roundStepUs(%g) = %d, want %d", c.us, got, c.want)
		}}
	}}
}}

func TestOverheads(t *testing.T) {{
	m := NewModel()
	for _, c := range []struct {{
		name string
		got  int64
		want int64
	}}{{
{method_rows}
	}} {{
		if c.got != c.want {{
			t.Errorf("%s = %d, Python expects %d", c.name, c.got, c.want)
		}}
	}}
}}

// benchBatch is a 128-request batch: 8 prefill chunks of 256 tokens and 120 decodes
// with contexts of a few hundred to a few thousand tokens.
func benchBatch() []*Request {{
	tokens := make([]int, goldenMaxModelLen)
	batch := make([]*Request, 128)
	for i := range batch {{
		if i%16 == 0 {{
			batch[i] = &Request{{ProgressIndex: 512, NumNewTokens: 256, InputTokens: tokens[:2048]}}
			continue
		}}
		in, out := 200+13*i, 1+17*i
		batch[i] = &Request{{ProgressIndex: int64(in + out - 1), NumNewTokens: 1, InputTokens: tokens[:in], OutputTokens: tokens[:out]}}
	}}
	return batch
}}

var benchSink int64

func BenchmarkStepTime(b *testing.B) {{
	m := NewModel()
	batch := benchBatch()
	b.ReportAllocs()
	b.ResetTimer()
	var sink int64
	for i := 0; i < b.N; i++ {{
		sink += m.StepTime(batch)
	}}
	benchSink = sink
}}

{GOLDEN_GENERATOR_GO}"""
    return text


def check_package_name(package: str) -> str:
    if not _GO_IDENT.match(package or "") or package in ("main",):
        raise InputError("package", None, f"expected a lower-case Go package name such as 'steptime', got {package!r}")
    return package


def export_go(
    entry: ArchiveEntry,
    deployment: Deployment | None,
    out_dir: str | Path,
    package: str = "steptime",
    interface: str = "seed",
    n_golden: int = 1000,
    seed: int = 0,
    expr: sp.Expr | None = None,
) -> list[Path]:
    """Write step_time.go, step_time_test.go (and go.mod unless OUT_DIR is already inside a
    Go module); return the paths written.

    EXPR overrides the parsed ``entry.expression`` (the same expression as sympy).
    DEPLOYMENT None means the run's first deployment (``default_deployment``, built-in
    model configs and GPU).
    """
    check_package_name(package)
    if interface not in INTERFACES:
        raise InputError("interface", None, f"expected one of {list(INTERFACES)}, got {interface!r}")
    if int(n_golden) < 1:
        raise InputError("n_golden", None, f"expected at least 1 golden batch, got {n_golden!r}")
    expr = parse_entry_expression(entry) if expr is None else sp.sympify(expr)
    if deployment is None:  # the constants must come from somewhere: the run's first deployment
        deployment = default_deployment(entry, DeploymentResolver())
    overheads, defaulted = resolve_overheads(entry)
    try:
        model_src = model_file_source(expr, deployment, entry, package, interface, overheads, defaulted)
    except GoPrintError as exc:
        raise InputError(f"archive entry {entry.id}", "expression", str(exc)) from None
    test_src = golden_test_source(expr, deployment, package, interface, overheads, int(n_golden), int(seed))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    model_path, test_path = out / "step_time.go", out / "step_time_test.go"
    model_path.write_text(model_src)
    test_path.write_text(test_src)
    written += [model_path, test_path]
    if enclosing_go_mod(out) is None:  # inside a module (e.g. BLIS's tree) the package joins it
        gomod = out / "go.mod"
        gomod.write_text(f"module {package}\n\ngo {GO_VERSION}\n")
        written.append(gomod)
    return written


def enclosing_go_mod(directory: Path) -> Path | None:
    """The go.mod of DIRECTORY or of the nearest parent that has one."""
    for d in [Path(directory).resolve(), *Path(directory).resolve().parents]:
        if (d / "go.mod").is_file():
            return d / "go.mod"
    return None



# --- which deployment to bake in when the user names none -------------------------------
@dataclass(frozen=True)
class RunDeployment:
    """A deployment an archived run trained on: one experiment's model and TP."""

    experiment: str
    model: str  # as the data names it: a trace name ("llama-2-70b") or an HF id
    tp: int
    gpu: str | None  # the trace's gpu column, if any
    source: str  # the trace file or experiment directory it was read from


_TRACE_ID_COLUMNS = ("experiment_id", "model", "tp")


def _run_base_dirs(config: dict, run_dir: Path | None) -> list[Path]:
    """Directories relative data paths of a run may be relative to.

    The run recorded its paths as typed, relative to where ``evolve run`` was started;
    that directory is recovered from the recorded ``run_dir`` and where the run lives
    now (``runs/<id>`` started in P -> P). The current directory is tried first.
    """
    bases = [Path.cwd()]
    if run_dir is not None:
        here = Path(run_dir).resolve()
        recorded = Path(str(config.get("run_dir") or ""))
        if str(recorded) not in ("", ".") and not recorded.is_absolute():
            parts = recorded.parts
            if len(parts) <= len(here.parts) and here.parts[-len(parts):] == parts:
                bases.append(Path(*here.parts[: len(here.parts) - len(parts)]))
        bases += [here, here.parent, here.parent.parent]
    unique: list[Path] = []
    for b in bases:
        if b not in unique:
            unique.append(b)
    return unique


def _locate(path: str, bases: list[Path]) -> Path | None:
    p = Path(path).expanduser()
    if p.is_absolute():
        return p if p.exists() else None
    return next((b / p for b in bases if (b / p).exists()), None)


def _trace_deployments(path: Path) -> list[RunDeployment]:
    """(experiment, model, tp, gpu) of a step trace, reading only those columns."""
    from primitives.data.traces import STEP_FILE_NAMES

    step_file = path
    if path.is_dir():
        step_file = next((path / n for n in STEP_FILE_NAMES if (path / n).is_file()), None)
        if step_file is None:
            raise InputError(path, None, f"no step trace here; expected one of {', '.join(STEP_FILE_NAMES)}")
    try:
        import pandas as pd

        if step_file.suffix == ".parquet":
            import pyarrow.parquet as pq

            names = pq.read_schema(step_file).names
            wanted = [c for c in (*_TRACE_ID_COLUMNS, "gpu") if c in names]
            df = pd.read_parquet(step_file, columns=wanted)
        elif step_file.suffix == ".csv":
            df = pd.read_csv(step_file, usecols=lambda c: c in (*_TRACE_ID_COLUMNS, "gpu"))
        else:
            raise InputError(step_file, None, "unsupported file type; expected .parquet or .csv")
    except InputError:
        raise
    except Exception as exc:  # pyarrow/pandas parse errors: one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(step_file, None, f"cannot read the trace's deployments ({first[:120]})") from None
    missing = [c for c in _TRACE_ID_COLUMNS if c not in df.columns]
    if missing:
        raise InputError(step_file, missing[0], "missing column; cannot tell which deployment the run used")
    if "gpu" not in df.columns:
        df["gpu"] = ""
    df = df.dropna(subset=list(_TRACE_ID_COLUMNS)).drop_duplicates("experiment_id")
    out = []
    for row in df.itertuples(index=False):
        try:
            tp = int(row.tp)
        except (TypeError, ValueError):
            continue
        gpu = str(row.gpu) if isinstance(row.gpu, str) and row.gpu.strip() and row.gpu != "nan" else None
        out.append(RunDeployment(str(row.experiment_id), str(row.model), tp, gpu, str(step_file)))
    return sorted(out, key=lambda d: d.experiment)


def run_deployments(entry: ArchiveEntry, run_dir: str | Path | None = None) -> list[RunDeployment]:
    """The deployments ENTRY's run trained on, first the one ``default_deployment`` takes.

    From the run's step traces (``run_config['data']``; none recorded means the
    embedded default data, ``primitives.data.roots.default_data_dir()``), else from its
    experiment directories (``run_config['experiments']``). Experiments ENTRY was scored
    on come first, then by name. RUN_DIR (where the run lives now) helps find data the
    run named by relative paths. Raises InputError when none can be found.
    """
    from primitives.data.roots import default_data_dir
    from primitives.data.traces import STEP_FILE_NAMES

    config = dict(entry.run_config or {})
    bases = _run_base_dirs(config, Path(run_dir) if run_dir is not None else None)
    found: list[RunDeployment] = []
    tried: list[str] = []
    data = [str(p) for p in (config.get("data") or [])]
    if data:
        for p in data:
            path = _locate(p, bases)
            if path is None:
                tried.append(f"data {p} (not found)")
            else:
                found += _trace_deployments(path)
    else:
        default = default_data_dir()
        if any((default / n).is_file() for n in STEP_FILE_NAMES):
            found += _trace_deployments(default)
        else:
            tried.append(f"the embedded default data ({default}: not there)")
    if not found and config.get("experiments"):
        path = _locate(str(config["experiments"]), bases)
        if path is None:
            tried.append(f"experiments {config['experiments']} (not found)")
        else:
            from primitives.data.experiments import find_experiments

            found += [RunDeployment(s.name, s.model, int(s.tp), None, str(s.path)) for s in find_experiments(path)]
    if not found:
        raise InputError(
            f"archive entry {entry.id}", "run_config",
            "cannot tell which deployment the run used (tried "
            + (", ".join(tried) or "nothing: the entry records no run configuration")
            + "); pass --model NAME --tp N",
        )
    scored = set(entry.per_experiment or {})
    seen, unique = set(), []
    for d in sorted(found, key=lambda d: (d.experiment not in scored, d.experiment)):
        if d.experiment not in seen:
            seen.add(d.experiment)
            unique.append(d)
    return unique


def default_deployment(
    entry: ArchiveEntry,
    resolver: DeploymentResolver,
    *,
    gpu: str | None = None,
    run_dir: str | Path | None = None,
) -> Deployment:
    """The deployment to bake in when none is named: the first of ``run_deployments``.

    GPU overrides the trace's gpu column (default: the resolver's default GPU).
    """
    first = run_deployments(entry, run_dir)[0]
    return resolver.resolve(first.model, first.tp, gpu or first.gpu)

__all__ = [
    "INTERFACES",
    "OVERHEAD_KEYS",
    "RunDeployment",
    "default_deployment",
    "enclosing_go_mod",
    "export_go",
    "golden_test_source",
    "model_file_source",
    "parse_entry_expression",
    "run_deployments",
]
