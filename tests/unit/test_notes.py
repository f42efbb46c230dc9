"""Notes that cannot rot: every reference to a Note resolves to the one file that holds it.

A Note states one invariant in full, once; code and docs elsewhere point back at it. The
grammar, as this code base writes it (the repository's Python, C/C++, Markdown, shell and
TOML files; this file's own examples excepted):

- A *definition* opens a comment or docstring line: ``Note [name]:`` after nothing but
  indentation, a comment leader (``#``, ``//``, ``/*``, ``*``), a list item's ``-`` or a
  string's opening quotes; or a comment line that is ``Note [name]`` alone, the heading of the block below it. Markdown
  defines no Notes: it points at them. A Note has one home, the file holding its definition
  (the definition may come back in that file, e.g. in the docstring of the function that
  keeps it).
- Every other ``Note [name]`` is a *reference*, and so is each further ``[name]`` of a list:
  ``Note [a], [b]``, ``Note [a] and [b]``, ``Note [a]; [b]``, ``Note [a], Note [b]``. A name
  may wrap onto the next line (comment leaders are read past). One that opens inside a code
  span (between backticks, as in CONTRIBUTING.md's account of this grammar) is an example.
- ``in F`` after a name says where that Note lives: ``Note [a] in _swap_pipeline.py``. ``F``
  is a path in the repository or its tail (``_layout.py``, ``aio/_checksum.py``,
  ``native/host_alloc/host_alloc.cpp``), in backticks or not. In a list, a name without its
  own ``in`` lives where a bare reference does (below) or in the ``F`` of the next name of
  the list that has one: in ``Note [a], [b] in aio/_memory.py`` both may live in
  aio/_memory.py; in docs/architecture.md's ``Note [shard layout], [frozen parameters] in
  `_layout.py``` the first lives in a module its entry names.

The checks: each Note has one home; ``in F`` names a file of the repository (no absolute
path, nothing above the root) and that file is the Note's home; a bare reference sits in the
Note's home (or its list's ``F`` is the home), except in Markdown, where the Note's home may
also be a file named in the same paragraph, list item or table row (docs/architecture.md: "it lives in the module named on
the same line unless 'in `file`' says otherwise"). And no file cites a document outside the
repository: every ``*.md`` named, and DESIGN (the design notes kept beside the repository),
must be a file in it."""
from __future__ import annotations

import bisect
import os
import re
import subprocess
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
SUFFIXES = (".py", ".pyi", ".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".md", ".sh", ".toml")
SKIP_DIRS = {"build", "dist", "runs", "__pycache__", "node_modules"}

_NAME = r"\[([^\]\[]+)\]"
_FILE = r"`{0,2}([\w./-]+\.(?:pyi|py|cpp|cc|cuh|cu|c|hpp|h|md|sh|toml))\b`{0,2}"
_IN = rf"(?:\s+in\s+{_FILE})?"
LEADER = re.compile(r"^\s*(?:#+|//+|/\*+|\*+)?")
DEFINITION = re.compile(r"^\s*(?:#+|//+|/\*+|\*+|-)?\s*(?:[rRbBuU]{0,2}(?:\"\"\"|'''|\"))?\s*Note \[([^\]\[]+)\](?::|\s*$)")
FIRST = re.compile(rf"Note\s+{_NAME}{_IN}")
MORE = re.compile(rf"(?:\s*,\s*(?:and\s+)?|\s*;\s*|\s+and\s+)(?:Note\s+)?{_NAME}{_IN}")
ENTRY_START = re.compile(r"\s*(?:[-*+] |\d+\. |\||#)")  # a Markdown list item, table row or heading
CODE_SPAN = re.compile(r"(`{1,2})[^`]{1,200}?\1")  # `...` or ``...``
NAMED = re.compile(rf"{_FILE}|`([\w./-]+/?)`")  # a file, or a folder in backticks


@dataclass(frozen=True)
class Ref:
    path: str   # the file the reference is in
    line: int
    name: str
    in_file: str | None  # F of "in F"
    list_file: str | None = None  # without in_file: the F of the next name of its list that has one

    def __str__(self):
        return f"{self.path}:{self.line}: Note [{self.name}]" + (f" in {self.in_file}" if self.in_file else "")


def _norm(name: str) -> str:
    return " ".join(name.split())


def repo_files() -> list[str]:
    """The repository's text files of the kinds above: git's tracked and untracked-but-not-ignored
    files, or a walk that leaves out hidden and build folders where there is no git."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True, timeout=60).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        out = []
        for dirpath, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS and not d.endswith(".egg-info")]
            out += [Path(dirpath, f).relative_to(ROOT).as_posix() for f in files]
    return sorted(f for f in out if f.endswith(SUFFIXES) and f != SELF and (ROOT / f).is_file())


def definitions(path: str, lines: list[str]) -> set[str]:
    if path.endswith(".md"):
        return set()
    return {_norm(m.group(1)) for m in map(DEFINITION.match, lines) if m}


def references(text: str) -> list[tuple[int, str, str | None, str | None]]:
    """(offset, name, F or None, the list's next F or None) of each reference in ``text``
    (comment leaders already removed)."""
    found, pos = [], 0
    examples = [m.span() for m in CODE_SPAN.finditer(text)]
    while m := FIRST.search(text, pos):
        group = [(m.start(), _norm(m.group(1)), m.group(2))]
        pos = m.end()
        while n := MORE.match(text, pos):
            group.append((n.start(), _norm(n.group(1)), n.group(2)))
            pos = n.end()
        if any(a < m.start() < b for a, b in examples):
            continue
        for i, (offset, name, in_file) in enumerate(group):
            later = None if in_file else next((f for _, _, f in group[i + 1:] if f), None)
            found.append((offset, name, in_file, later))
    return found


def _joined(lines: list[str], first_line: int = 1) -> tuple[str, list[int], int]:
    """The lines without comment leaders, joined by spaces, with each line's offset."""
    parts, starts, pos = [], [], 0
    for line in lines:
        part = LEADER.sub("", line, count=1).strip()
        starts.append(pos)
        parts.append(part)
        pos += len(part) + 1
    return " ".join(parts), starts, first_line


def _entries(lines: list[str]):
    """A Markdown file's paragraphs, list items (with their indented continuation) and table rows:
    (first line number, lines)."""
    entry, start = [], 1
    for i, line in enumerate(lines, 1):
        if not line.strip() or ENTRY_START.match(line):
            if entry:
                yield start, entry
            entry, start = ([], i + 1) if not line.strip() else ([line], i)
        else:
            entry.append(line)
    if entry:
        yield start, entry


def scan(files: list[str]):
    """(homes: name -> files defining it, references, files named by the Markdown entry of each
    bare Markdown reference)."""
    homes: dict[str, set[str]] = defaultdict(set)
    refs: list[Ref] = []
    entry_files: dict[Ref, set[str]] = {}
    for path in files:
        lines = (ROOT / path).read_text(encoding="utf-8", errors="replace").split("\n")
        for name in definitions(path, lines):
            homes[name].add(path)
        chunks = list(_entries(lines)) if path.endswith(".md") else [(1, lines)]
        for first, chunk in chunks:
            text, starts, _ = _joined(chunk)
            named = {t for m in NAMED.finditer(text) for t in m.groups() if t} if path.endswith(".md") else set()
            for offset, name, in_file, list_file in references(text):
                ref = Ref(path, first + bisect.bisect_right(starts, offset) - 1, name, in_file, list_file)
                refs.append(ref)
                if path.endswith(".md") and not in_file:
                    entry_files[ref] = {f for t in named for f in files_named(t, files)}
    return homes, refs, entry_files


def files_named(token: str, files: list[str]) -> list[str]:
    """The repository's files a path or its tail names (``_layout.py``, ``aio/_memory.py``), or
    the files under a folder it names (``aio/``, ``native/host_alloc``); none for a path that
    leaves the repository."""
    token = token.strip("`")
    if token.startswith(("/", "../")) or "/../" in token:
        return []
    if token.endswith(SUFFIXES):
        return [f for f in files if f == token or f.endswith("/" + token)]
    folder = "/" + token.strip("/") + "/"
    return [f for f in files if folder in "/" + f]


@pytest.fixture(scope="module")
def notes():
    files = repo_files()
    return (files, *scan(files))


def test_each_note_has_one_home(notes):
    _, homes, _, _ = notes
    assert len(homes) > 50, f"found only {len(homes)} Notes: the definition pattern no longer matches the code"
    twice = {name: sorted(where) for name, where in homes.items() if len(where) > 1}
    assert not twice, ("each Note is defined in one file; elsewhere write `Note [name] in FILE`:\n"
                       + "\n".join(f"  Note [{n}]: {', '.join(w)}" for n, w in sorted(twice.items())))


def test_every_reference_resolves(notes):
    files, homes, refs, entry_files = notes
    assert len(refs) > 300, f"found only {len(refs)} references: the reference pattern no longer matches the code"
    problems = []
    for ref in refs:
        home = homes.get(ref.name)
        if not home:
            problems.append(f"{ref}: no file defines this Note")
        elif ref.in_file:
            named = files_named(ref.in_file, files)
            if not named:
                problems.append(f"{ref}: {ref.in_file} is not a file of the repository")
            elif not home & set(named):
                problems.append(f"{ref}: the Note is in {', '.join(sorted(home))}")
        else:
            here = entry_files[ref] if ref.path.endswith(".md") else {ref.path}
            there = set(files_named(ref.list_file, files)) if ref.list_file else set()
            if not home & (here | there):
                problems.append(f"{ref}: the Note is in {', '.join(sorted(home))} (add `in FILE`)")
    assert not problems, f"{len(problems)} Note references do not resolve:\n" + "\n".join(problems)


DOCUMENT = re.compile(r"(?<![\w/.-])((?:\.\./|/)?[\w./-]*[\w-]\.md|DESIGN)\b")


def test_no_file_cites_a_document_outside_the_repository(notes):
    files = notes[0]
    problems = []
    for path in files:
        for i, line in enumerate((ROOT / path).read_text(encoding="utf-8", errors="replace").split("\n"), 1):
            for m in DOCUMENT.finditer(line):
                doc = "DESIGN.md" if m.group(1) == "DESIGN" else m.group(1)
                here = os.path.normpath(os.path.join(os.path.dirname(path), doc))
                outside = doc.startswith("/") or here.startswith("..")  # docs/guides' ../config.md is inside
                if outside or not ((ROOT / here).is_file() or files_named(doc, files)):
                    problems.append(f"{path}:{i}: {m.group(1)}")
    assert not problems, "documents outside the repository (a reader of the repository cannot follow them):\n" + \
        "\n".join(problems)


# ---------------------------------------------------------------- the grammar itself


@pytest.mark.parametrize("line, name", [
    ('"""Note [shard layout]: bandwidth-centric partitioning', "shard layout"),
    ("Note [frozen parameters]: the parameter store holds", "frozen parameters"),
    ("    # Note [binary data]: a .txt file that is not text", "binary data"),
    ("// Note [block sums]: one entry per 4 KiB block", "block sums"),
    ("# Note [ranks from a forkserver]", "ranks from a forkserver"),
    ("- Note [contender rounds]: machines drift", "contender rounds"),
    ("x = 1  # Note [host cache]: in memory only", None),          # after code: a reference
    ('"""Note [overlapped step] in _zero_optimizer.py: once the first chunk', None),
    ("the writer rank's side of Note [bounded export]: a host copy", None),
])
def test_what_a_definition_is(line, name):
    assert definitions("m.py", [line]) == ({name} if name else set())
    assert definitions("m.md", [line]) == set()  # Markdown points at Notes only


@pytest.mark.parametrize("lines, want", [
    (["(Note [a] in _layout.py)"], [("a", "_layout.py")]),
    (["Note [a], [b] in `aio/_memory.py`; [c]."], [("a", "aio/_memory.py"), ("b", "aio/_memory.py"), ("c", None)]),
    (["Note [a] in _x.py and Note [b]", "in native/aio/sums.h"], [("a", "_x.py"), ("b", "native/aio/sums.h")]),
    (["# the swap pipeline (Note [phased swap", "# I/O] in _swap_pipeline.py)"], [("phased swap I/O", "_swap_pipeline.py")]),
    (["Note [a] in the engine, [b]"], [("a", None)]),  # "in" not followed by a file; [b] is no list item
    (["opens with `Note [name]:`, points back with ``Note [name] in FILE``; Note [c] in `_c.py`"], [("c", "_c.py")]),
])
def test_what_a_reference_is(lines, want):
    text = _joined(lines)[0]
    assert [(name, in_file or later) for _, name, in_file, later in references(text)] == want


def test_a_markdown_entry_names_where_its_bare_notes_live(tmp_path):
    files = ["docs/x.md", "infinity/_zero/_unit.py", "infinity/_offload/_layout.py", "infinity/aio/_memory.py"]
    md = ["- **shard layout** (`_unit.py`, `_layout.py`): Note [shard layout],",
          "  [frozen parameters] in `_layout.py`.", "", "A paragraph: Note [released pages]; the `aio/` folder.",
          "| row | Note [shard layout] |"]
    entries = list(_entries(md))
    assert [(first, len(lines)) for first, lines in entries] == [(1, 2), (4, 1), (5, 1)]
    named = [{t for m in NAMED.finditer(_joined(lines)[0]) for t in m.groups() if t} for _, lines in entries]
    assert {f for t in named[0] for f in files_named(t, files)} == {"infinity/_zero/_unit.py", "infinity/_offload/_layout.py"}
    assert {f for t in named[1] for f in files_named(t, files)} == {"infinity/aio/_memory.py"}
    assert named[2] == set()
    assert files_named("../shared/DESIGN.md", files + ["shared/DESIGN.md"]) == []
