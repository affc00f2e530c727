"""Named sections of a generated markdown file, between comment markers.

``BENCHMARKS.md`` is written by two tools: ``kvpush bench --publish``
regenerates the whole file, and the soak (``python -m kvpush_lab.soak
--publish``) owns one section of it::

    <!-- soak:begin -->
    ## Soak
    ...
    <!-- soak:end -->

The soak replaces its section (or appends it); the benchmark carries every
section it finds in the old file over into the new one, and ``kvpush bench
--publish --section NAME`` (the multi-host rehearsal's runs) writes its
report into section ``NAME`` instead of the whole file. Pure text functions.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"^[a-z][a-z0-9-]*$")
_BEGIN = re.compile(r"<!-- ([a-z][a-z0-9-]*):begin -->")


def begin_marker(name: str) -> str:
    return f"<!-- {_checked(name)}:begin -->"


def end_marker(name: str) -> str:
    return f"<!-- {_checked(name)}:end -->"


def _checked(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(
            f"section name {name!r} must be lowercase letters, - or digits"
        )
    return name


def _span(text: str, name: str) -> tuple[int, int] | None:
    """Start of the begin marker and end of the end marker, if both exist
    in that order."""
    begin = text.find(begin_marker(name))
    if begin < 0:
        return None
    end = text.find(end_marker(name), begin)
    if end < 0:
        return None
    return begin, end + len(end_marker(name))


def find_section(text: str, name: str) -> str | None:
    """The body of section ``name`` (between its markers, stripped), or None."""
    span = _span(text, name)
    if span is None:
        return None
    inner = text[span[0] + len(begin_marker(name)) : span[1] - len(end_marker(name))]
    return inner.strip()


def put_section(text: str, name: str, body: str) -> str:
    """``text`` with section ``name`` set to ``body``: replaced where it is,
    or appended at the end."""
    block = f"{begin_marker(name)}\n{body.strip()}\n{end_marker(name)}"
    span = _span(text, name)
    if span is not None:
        return text[: span[0]] + block + text[span[1] :]
    head = text.rstrip()
    return f"{head}\n\n{block}\n" if head else f"{block}\n"


def section_names(text: str) -> list[str]:
    """The names of the complete sections in ``text``, in order."""
    return [m.group(1) for m in _BEGIN.finditer(text) if _span(text, m.group(1))]


def check_section_name(name: str) -> str:
    """``name`` if it can name a section, else ValueError."""
    return _checked(name)


def demote_headings(markdown: str) -> str:
    """Every markdown heading one level down (``#`` -> ``##``), outside
    fenced code blocks: a whole report as a section of another file."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,5} ", line):
            line = "#" + line
        out.append(line)
    return "\n".join(out) + ("\n" if markdown.endswith("\n") else "")


def carry_sections(old: str, new: str, names: tuple[str, ...]) -> str:
    """``new`` with each named section of ``old`` put into it (sections
    ``old`` lacks are left as ``new`` has them)."""
    for name in names:
        body = find_section(old, name)
        if body is not None:
            new = put_section(new, name, body)
    return new
