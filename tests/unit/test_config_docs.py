"""docs/config.md is generated from the schema (scripts/gen_config_docs.py): a key, default or
help text changed in infinity/config/schema.py without regenerating the page fails here."""
import importlib.util
from pathlib import Path

from infinity.config import Config, all_key_paths

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_config_docs.py"
PAGE = ROOT / "docs" / "config.md"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_page_is_what_the_schema_gives():
    assert PAGE.read_text() == _generator().render(), "docs/config.md is stale: run python scripts/gen_config_docs.py"


def test_every_key_has_one_row_with_its_default_and_meaning():
    rows = [line for line in _generator().render().split("\n") if line.startswith("| `")]
    keys = [row.split("`", 2)[1] for row in rows]
    assert len(keys) == len(set(keys)) and sorted(keys) == sorted(all_key_paths())
    reference = set(Config.reference_markdown().strip().split("\n")[2:])
    assert set(rows) == reference  # each row as the schema renders it: type, default, help and bounds
    assert all(row.split(" | ")[3].strip(" |") for row in rows), "a key without help text in schema.py"


def test_each_section_is_introduced_once_and_listed_in_the_contents():
    text = _generator().render()
    for section in ("zero", "zero.offload_param", "zero.offload_optimizer", "zero.prefetch", "precision", "aio",
                    "train", "scheduler", "activation_checkpointing"):
        assert text.count(f"# `{section}`\n") == 1
        assert f"[`{section}`](#{section.replace('.', '')})" in text


def test_check_mode_reports_a_stale_page(tmp_path, monkeypatch):
    gen = _generator()
    stale = tmp_path / "config.md"
    stale.write_text(gen.render().replace("| `zero.stage` |", "| `zero.stages` |"))
    monkeypatch.setattr(gen, "OUTPUT", stale)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
