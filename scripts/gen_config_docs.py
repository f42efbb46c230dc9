"""Write docs/config.md, the configuration reference, from the schema (infinity/config/schema.py).

    python scripts/gen_config_docs.py          # rewrite docs/config.md
    python scripts/gen_config_docs.py --check  # exit 1 if docs/config.md is not what the schema gives

Every key's row (type, default, meaning, bounds) is ``infinity.Config.reference_markdown()``, the
one renderer of a key's metadata; this script only orders the rows by section and puts each
section's help text and docstring above its table. ``tests/unit/test_config_docs.py`` fails when
the file is stale.
"""
from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

from infinity.config import Config

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "config.md"

HEADER = """\
# Configuration reference

<!-- Generated from infinity/config/schema.py by `python scripts/gen_config_docs.py`; do not edit by hand.
     tests/unit/test_config_docs.py fails when this file and the schema disagree. -->

A config is a YAML or JSON file, a dict, or an `infinity.Config`: `infinity.Config.from_file(path)`,
`infinity.Config.from_dict(d)`, `infinity.Config.from_deepspeed(ds_json_or_path)` (a DeepSpeed JSON as
written for transformers or accelerate; `from_file` and `python -m infinity.train --config` detect one).
Every key is optional; `infinity.Config()` is valid (stage 3, nothing offloaded, fp32). A config is
validated as a whole when it is built: an unknown key, a value of the wrong type or out of its bounds,
and keys that contradict each other are all reported at once, each with its key path and what to write
instead (the nearest valid name for a misspelt key).

Nested keys are written as sections, e.g. `zero.offload_optimizer.device` is

```yaml
zero:
  offload_optimizer:
    device: nvme
```

Sizes given as strings (`device_memory_limit`) accept units such as `8GB` (10^9) or `512MiB` (2^20).
"""


def _sections(cls: type, prefix: str = ""):
    """(key prefix, help text, docstring, depth) of ``cls`` and of each section below it, in
    declaration order; internal fields (not config keys) are left out."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if f.metadata.get("internal") or not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            continue
        path = prefix + f.name
        yield path, f.metadata.get("help", ""), " ".join((hint.__doc__ or "").split()), path.count(".")
        yield from _sections(hint, path + ".")


def _rows() -> dict:
    """The reference table's rows by key path, and its two header lines under ''."""
    lines = Config.reference_markdown().strip().split("\n")
    rows = {"": lines[:2]}
    for line in lines[2:]:
        rows[line.split("`", 2)[1]] = line
    return rows


def _table(head: list, rows: list) -> str:
    return "\n".join(head + rows) + "\n"


def render() -> str:
    rows = _rows()
    head = rows.pop("")
    sections = list(_sections(Config))
    section_paths = {path for path, *_ in sections}

    def owner(key: str) -> str:  # the deepest section holding the key, '' for a top-level key
        parts = key.split(".")[:-1]
        while parts and ".".join(parts) not in section_paths:
            parts.pop()
        return ".".join(parts)

    by_section: dict = {}
    for key, row in rows.items():
        by_section.setdefault(owner(key), []).append(row)

    out = [HEADER, "## Sections\n"]
    if by_section.get(""):
        out.append("- [top-level keys](#top-level-keys)")
    for path, help_text, _, depth in sections:
        out.append(f"{'  ' * depth}- [`{path}`](#{path.replace('.', '')}): {help_text}")
    out.append("")
    if by_section.get(""):
        out += ["## Top-level keys\n", _table(head, by_section.pop(""))]
    for path, help_text, doc, depth in sections:
        out.append(f"{'#' * min(depth + 2, 4)} `{path}`\n")
        out.append(f"{doc or help_text}\n")
        if by_section.get(path):
            out.append(_table(head, by_section.pop(path)))
    assert not by_section, f"keys in no section: {sorted(by_section)}"
    return "\n".join(out).rstrip() + "\n"


def main(argv: list) -> int:
    text = render()
    if "--check" in argv:
        if OUTPUT.exists() and OUTPUT.read_text() == text:
            return 0
        print(f"{OUTPUT.relative_to(ROOT)} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
        return 1
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
