"""A BLIS checkout: is it one we generate for, and registering a backend in it.

``check_checkout`` refuses (one line) a folder that is not BLIS or whose
``sim.LatencyModel`` differs from the four methods the backend implements.
``register_backend`` makes the edits BLIS needs for a new backend, idempotently
(exporting again replaces, never duplicates), and says what it changed:

* ``sim/latency/latency.go``: the factory's ``case "NAME":``;
* ``sim/bundle.go``: ``validLatencyBackends``; ``sim/bundle_test.go``: its pinned list;
* ``cmd/root.go``, ``cmd/replay.go``: the backend resolves its model config and GPU
  datasheet as roofline does, and joins the analytical backends that get config.json
  facts and automatic KV-block sizing; in ``cmd/root.go`` the block count it gets
  (unless ``--total-kv-blocks`` is given) is then vLLM's, from the generated
  ``KVBlocks``, not BLIS's own estimate (TP times too many blocks at TP > 1).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from primitives.errors import InputError
from primitives.files import atomic_write_text
from translate_go.blis_model import BLIS_MODULE, go_prefix
from translate_go.model_file import INTERFACE_METHODS

LATENCY_MODEL_FILE = "sim/latency_model.go"
FACTORY_FILE = "sim/latency/latency.go"
BUNDLE_FILE = "sim/bundle.go"
BUNDLE_TEST_FILE = "sim/bundle_test.go"
CMD_FILES = ("cmd/root.go", "cmd/replay.go")
MARK = "stepsynth export-go"
_BUILTIN_BACKENDS = ("", "roofline", "trained-physics")
BACKEND_NAME = re.compile(r"^[a-z][a-z0-9-]*$")


def check_backend_name(name: str) -> str:
    if not BACKEND_NAME.match(name or "") or name in _BUILTIN_BACKENDS:
        raise InputError(
            "--name", None, f"expected a new backend name of lower-case letters, digits and '-', got {name!r}"
        )
    return name


def _read(root: Path, rel: str) -> str:
    path = root / rel
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(path, None, f"expected a BLIS checkout file here ({exc.strerror})") from None
    except UnicodeDecodeError as exc:  # a binary or other-encoded file where BLIS keeps Go source
        raise InputError(
            path, None, f"not a text file (byte {exc.start} is not UTF-8); expected BLIS's Go source"
        ) from None


def _interface_methods(text: str) -> list[str] | None:
    m = re.search(r"^type LatencyModel interface \{\n(.*?)^\}", text, re.M | re.S)
    if m is None:
        return None
    methods = []
    for line in m.group(1).splitlines():
        code = line.split("//", 1)[0].strip()
        if code:
            methods.append(" ".join(code.split()))
    return methods


def check_checkout(root: Path) -> None:
    """Refuse, in one line, anything but a BLIS checkout with the interface we generate for."""
    if not root.is_dir():
        raise InputError(root, "--blis", "expected the folder of a BLIS checkout (inference-sim)")
    module = re.search(r"^module\s+(\S+)", _read(root, "go.mod"), re.M)
    if module is None or module.group(1) != BLIS_MODULE:
        raise InputError(root / "go.mod", "module", f"expected module {BLIS_MODULE}, got {module and module.group(1)}")
    want = list(INTERFACE_METHODS["blis"])
    got = _interface_methods(_read(root, LATENCY_MODEL_FILE))
    if got != want:
        raise InputError(
            root / LATENCY_MODEL_FILE,
            "LatencyModel",
            f"this export generates for the methods {'; '.join(want)}, the checkout has {got}",
        )
    for rel in (FACTORY_FILE, BUNDLE_FILE, BUNDLE_TEST_FILE, *CMD_FILES):
        _read(root, rel)


def _need(found: bool, root: Path, rel: str, what: str) -> None:
    if not found:
        raise InputError(root / rel, None, f"cannot register the backend: {what} not found (an unknown BLIS version?)")


def _factory(text: str, name: str, root: Path) -> tuple[str, str]:
    _, upper = go_prefix(name)
    case = (
        f'\tcase "{name}": // {MARK}: sim/latency/{file_stem(name)}.go\n'
        f"\t\tmodel, err := New{upper}Model(hw)\n"
        "\t\tif err != nil {\n\t\t\treturn nil, err\n\t\t}\n\t\treturn model, nil\n"
    )
    old = re.search(rf'^\tcase "{re.escape(name)}":.*?\n(?=\tcase |\tdefault:)', text, re.M | re.S)
    if old:
        return (text, "unchanged") if old.group(0) == case else (text.replace(old.group(0), case), "replaced")
    switch = text.find("switch hw.Backend {")
    default = text.find("\tdefault:\n", switch)
    _need(switch >= 0 and default >= 0, root, FACTORY_FILE, "NewLatencyModel's switch hw.Backend with a default case")
    return text[:default] + case + text[default:], "added"


def _bundle(text: str, name: str, root: Path) -> tuple[str, str]:
    m = re.search(r"(validLatencyBackends\s*=\s*map\[string\]bool\{)([^}]*)\}", text)
    _need(m is not None, root, BUNDLE_FILE, "validLatencyBackends")
    if f'"{name}": true' in m.group(2):
        return text, "unchanged"
    return text[: m.end(2)] + f', "{name}": true' + text[m.end(2) :], "added"


def _bundle_test(text: str, name: str, root: Path) -> tuple[str, str]:
    func = text.find("func TestValidLatencyBackendNames_ExcludesRemoved(")
    m = re.compile(r"expected := \[\]string\{([^}]*)\}").search(text, max(func, 0))
    _need(func >= 0 and m is not None, root, BUNDLE_TEST_FILE, "the pinned list of TestValidLatencyBackendNames_...")
    names = re.findall(r'"([^"]*)"', m.group(1))
    if name in names:
        return text, "unchanged"
    names.append(name)
    new = text[: m.start(1)] + ", ".join(f'"{n}"' for n in names) + text[m.end(1) :]
    new = re.sub(r"(// AND the list must contain exactly )\d+( backends)", rf"\g<1>{len(names)}\g<2>", new, count=1)
    return new, "added"


_ANALYTICAL = re.compile(
    r'((?:lr\.)?[Bb]ackend) == "roofline" \|\| \1 == "trained-physics"((?: \|\| \1 == "[\w.-]+")*)'
)


def _resolution_block(name: str) -> str:
    return (
        f'\t// {MARK}: backend "{name}" reads the model config and GPU datasheet as roofline does.\n'
        f'\tif backend == "{name}" {{\n'
        '\t\tif gpu == "" || tensorParallelism <= 0 {\n'
        f'\t\t\tlogrus.Fatalf("--latency-model {name} requires --hardware and --tp (no defaults in defaults.yaml '
        'for model=%s)", model)\n'
        "\t\t}\n"
        "\t\tresolved, err := resolveModelConfig(model, modelConfigFolder, defaultsFilePath)\n"
        '\t\tif err != nil {\n\t\t\tlogrus.Fatalf("%v", err)\n\t\t}\n'
        "\t\tmodelConfigFolder = resolved\n"
        "\t\tresolvedHW, err := resolveHardwareConfig(hwConfigPath, defaultsFilePath)\n"
        '\t\tif err != nil {\n\t\t\tlogrus.Fatalf("%v", err)\n\t\t}\n'
        "\t\thwConfigPath = resolvedHW\n"
        "\t}\n\n"
    )


# (the line a block goes before, what to call it in a refusal): the config block before
# BLIS's own analytical backends' block; the KV block right after BLIS's own KV
# auto-calculation (and its explicit-flag branch) in resolveLatencyConfig
_CONFIG_ANCHOR = ("\t// Analytical backends: parse HF config", "the '// Analytical backends: parse HF config' block")
_KV_ANCHOR = (
    "\t\t// Auto-derive --max-model-len from HF config's max_position_embeddings.\n",
    "the '// Auto-derive --max-model-len from HF config' block",
)
_KV_END = "\t\t\ttotalKVBlocks = blocks\n\t\t}\n\n"


def _kv_block(name: str) -> str:
    """After BLIS's own KV auto-calculation: the backend's KV cache as vLLM's (``KVBlocks``)."""
    _, upper = go_prefix(name)
    hw = "sim.ModelHardwareConfig{ModelConfig: modelConfig, HWConfig: hwConfig, TP: tensorParallelism}"
    return (
        f'\t\t// {MARK}: backend "{name}" sizes the KV cache as vLLM does ({upper}KVBlocks),\n'
        "\t\t// not as BLIS's own estimate above (TP times the blocks at TP > 1).\n"
        f'\t\tif backend == "{name}" && !cmd.Flags().Changed("total-kv-blocks") {{\n'
        f"\t\t\tblocks, err := latency.{upper}KVBlocks({hw}, gpuMemoryUtilization, blockSizeTokens)\n"
        '\t\t\tif err != nil {\n\t\t\t\tlogrus.Fatalf("--latency-model %s: %v", backend, err)\n\t\t\t}\n'
        '\t\t\tlogrus.Infof("--latency-model %s: total-kv-blocks=%d, vLLM\'s KV cache", backend, blocks)\n'
        f"{_KV_END}"
    )


def _marked_block(text: str, block: str, marker: str, end_text: str, anchor: tuple, where: tuple) -> tuple[str, bool]:
    """TEXT with BLOCK in place of its earlier copy (from MARKER to END_TEXT), or inserted
    before ANCHOR's line (``_CONFIG_ANCHOR``, ``_KV_ANCHOR``); (text, whether it changed).
    WHERE is (root, rel) for a refusal.

    An earlier copy sits before the anchor and holds no other stepsynth block: where it does
    not (its end edited by hand, the marker twice), replacing up to the next END_TEXT would
    delete BLIS's code or another backend's block, and inserting would leave two copies."""
    anchor_text, anchor_name = anchor
    at = text.find(anchor_text)
    _need(at >= 0, *where, anchor_name)
    start = text.find(marker)
    if start < 0:
        return text[:at] + block + text[at:], True
    found = text.find(end_text, start)
    end = found + len(end_text)
    other = text.find(f"// {MARK}:", start + len(marker))  # the next stepsynth block, if any
    whole = found >= 0 and text.count(marker) == 1 and not start < at < end and not 0 <= other < end
    if not whole:
        root, rel = where
        what = f"the block marked '{marker.strip()}' is not as exported (its end edited, or marked twice)"
        raise InputError(root / rel, None, f"cannot register the backend: {what}; start from a fresh copy")
    return (text, False) if text[start:end] == block else (text[:start] + block + text[end:], True)


def _cmd(text: str, name: str, root: Path, rel: str) -> tuple[str, str]:
    changed = []

    def widen(m: re.Match) -> str:
        if f'{m.group(1)} == "{name}"' in m.group(0):
            return m.group(0)
        changed.append(m.group(1))
        return f'{m.group(0)} || {m.group(1)} == "{name}"'

    found = _ANALYTICAL.search(text) is not None
    text = _ANALYTICAL.sub(widen, text)
    if rel == "cmd/root.go":
        _need(found, root, rel, "the analytical-backend conditions")
        marker = f'\t// {MARK}: backend "{name}" reads'
        text, moved = _marked_block(text, _resolution_block(name), marker, "\n\t}\n\n", _CONFIG_ANCHOR, (root, rel))
        changed += ["config resolution"] * moved
        marker = f'\t\t// {MARK}: backend "{name}" sizes the KV cache'
        text, moved = _marked_block(text, _kv_block(name), marker, _KV_END, _KV_ANCHOR, (root, rel))
        changed += ["KV blocks"] * moved
    return text, f"{len(changed)} place(s) changed" if changed else "unchanged"


def file_stem(name: str) -> str:
    """sim/latency/<stem>.go of a backend: ``my-model`` -> ``my_model_latency``."""
    return name.replace("-", "_") + "_latency"


def plan_registration(root: Path, name: str) -> list[tuple[Path, str | None, str]]:
    """Every registration edit as (file, new text or None when unchanged, report line),
    computed before anything is written so that a checkout BLIS cannot take is refused whole."""
    edits = [
        (FACTORY_FILE, f'factory case "{name}"', _factory),
        (BUNDLE_FILE, "validLatencyBackends", _bundle),
        (BUNDLE_TEST_FILE, "pinned backend list", _bundle_test),
    ]
    plan = []
    for rel, what, edit in edits:
        text = _read(root, rel)
        new, outcome = edit(text, name, root)
        plan.append((root / rel, new if new != text else None, f"{rel}: {what} {outcome}"))
    for rel in CMD_FILES:
        text = _read(root, rel)
        new, outcome = _cmd(text, name, root, rel)
        line = f"{rel}: analytical backend (config.json, datasheet, KV blocks): {outcome}"
        plan.append((root / rel, new if new != text else None, line))
    return plan


def check_writable(paths: list[Path]) -> None:
    """Each file is replaced by a rename in its folder: both must be writable."""
    for path in paths:
        for target in (path.parent, path):
            if target.exists() and not os.access(target, os.W_OK):
                raise InputError(target, None, "not writable; export into a copy of the checkout")


def register_backend(root: Path, name: str, plan: list[tuple[Path, str | None, str]] | None = None) -> list[str]:
    """Make BLIS know backend NAME (PLAN from ``plan_registration``); one line per file."""
    plan = plan_registration(root, name) if plan is None else plan
    for path, text, _ in plan:
        if text is not None:
            atomic_write_text(path, text)
    return [line for _, _, line in plan]


__all__ = [
    "check_backend_name",
    "check_checkout",
    "check_writable",
    "file_stem",
    "plan_registration",
    "register_backend",
]
