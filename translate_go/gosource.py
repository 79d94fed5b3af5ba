"""Go source text shared by the generated files: templates, imports, aligned rows, comments.

The Go that does not depend on the expression lives in ``translate_go/templates/*.tmpl``
(``string.Template``: ``${name}`` placeholders; Go itself never uses ``$``), read as
package resources so that an installed package finds them too. Everything here lays
text out as gofmt would, so the generated files are gofmt-clean without a Go toolchain.
"""

from __future__ import annotations

import re
from importlib.resources import files
from string import Template
from typing import Sequence

# gofmt reads a comment line starting "- ", "1. ", "2) " or "# " as a list item or heading
_DOC_MARKER = re.compile(r"^([-*+\u2022]|\d+[.)]|#)(\s|$)")


def render_template(name: str, **values: object) -> str:
    """templates/NAME with every ``${placeholder}`` replaced from VALUES (all required)."""
    text = (files("translate_go") / "templates" / name).read_text(encoding="utf-8")
    return Template(text).substitute(values)


def go_imports(names: Sequence[str]) -> str:
    """The import declaration of NAMES (sorted, deduplicated; empty when none)."""
    names = sorted(set(names))
    if not names:
        return ""
    if len(names) == 1:
        return f'import "{names[0]}"\n'
    return "import (\n" + "".join(f'\t"{n}"\n' for n in names) + ")\n"


def align_rows(rows: Sequence[Sequence[str]], indent: str = "\t") -> list[str]:
    """Columns padded as gofmt's tabwriter pads them (one space minimum, last cell free)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=False)] + [r[-1]]
        out.append((indent + " ".join(cells)).rstrip())
    return out


def comment_lines(text: str, width: int = 88) -> list[str]:
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
    # gofmt would reformat a line starting with a list or heading marker; keep such words
    # at the end of the previous line.
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


def join_sections(sections: Sequence[str]) -> str:
    """Non-empty SECTIONS of a Go file, each ending in one newline, a blank line between."""
    return "\n".join(s.rstrip("\n") + "\n" for s in sections if s)


__all__ = ["align_rows", "comment_lines", "go_imports", "join_sections", "render_template"]
