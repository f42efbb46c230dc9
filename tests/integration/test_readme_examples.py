"""The README's examples run as written: every ```python block is a whole program, run in a fresh
interpreter from an empty directory, every ``python -m infinity.estimate`` command of a ```bash
block runs and prints what the ```text block after it shows (its lines, "..." standing for the rest),
and the install block's checks run where it says to run them: in a clone's root (a copy of the
repository's files without built libraries) against the installed package.

A block that is not meant to run is preceded by the line ``<!-- readme-test: skip -->``; keep
such blocks rare. The README stays a front door: at most 200 lines."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple

import pytest
from _jobs import Jobs

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SKIP = "<!-- readme-test: skip -->"
FENCE = re.compile(r"^```(\w*)\s*$")


class Block(NamedTuple):
    lang: str
    line: int     # the line of the opening fence
    text: str
    skipped: bool


def blocks(text: str) -> List[Block]:
    """The fenced blocks of a Markdown text, each with whether the skip marker precedes it."""
    found, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        found.append(Block(m.group(1), i + 1, "\n".join(lines[i + 1:end]) + "\n", before == SKIP))
        i = end + 1
    return found


def estimate_commands(found: List[Block]) -> List[tuple]:
    """(command, the lines the next ```text block shows) for each estimate command of a bash block."""
    out = []
    for k, block in enumerate(found):
        if block.lang != "bash" or block.skipped:
            continue
        for line in block.text.splitlines():
            if line.startswith("python -m infinity.estimate"):
                after = found[k + 1] if k + 1 < len(found) and found[k + 1].lang == "text" else None
                shown = [s for s in after.text.splitlines() if s.strip() and s.strip() != "..."] if after else []
                out.append((line, shown))
    return out


FOUND = blocks(README.read_text())
PROGRAMS = [b for b in FOUND if b.lang == "python" and not b.skipped]
COMMANDS = estimate_commands(FOUND)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every program and command started at once; each case waits for its own."""
    root = tmp_path_factory.mktemp("readme")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with Jobs(root) as running:
        for block in PROGRAMS:
            cwd = root / f"line{block.line}"
            cwd.mkdir()
            (cwd / "example.py").write_text(block.text)
            running.start(f"python:{block.line}", [sys.executable, "example.py"], env=env, cwd=str(cwd))
        for command, _ in COMMANDS:
            argv = shlex.split(command)
            running.start(command, [sys.executable] + argv[1:], env=env, cwd=str(root))
        yield running


def test_the_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert PROGRAMS, "the README has no runnable python block"
    assert sum(b.skipped for b in FOUND) <= 1, "keep blocks marked not to run rare"
    for command in ("bash scripts/run.sh", "bash scripts/test.sh"):  # CI calls the test command
        assert f"\n{command} " in text


@pytest.mark.parametrize("block", PROGRAMS, ids=[f"line{b.line}" for b in PROGRAMS])
def test_python_block_runs(jobs, block):
    proc = jobs.result(f"python:{block.line}", timeout=600)
    assert proc.returncode == 0, f"README.md:{block.line}:\n{proc.stderr[-4000:]}"
    assert "import infinity" in block.text and "infinity._" not in block.text  # the public API only


@pytest.mark.parametrize("command, shown", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_estimate_command_prints_what_the_readme_shows(jobs, command, shown):
    proc = jobs.result(command, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = {" ".join(line.split()) for line in proc.stdout.splitlines()}
    missing = [line for line in shown if " ".join(line.split()) not in printed]
    assert not missing, f"the README shows lines `{command}` no longer prints: {missing}\n{proc.stdout}"


def install_checks(found: List[Block]) -> List[str]:
    """The commands of the install block (the ```bash block that runs ``pip install``) other than pip's."""
    install = next(b for b in found if b.lang == "bash" and "pip install" in b.text)
    lines = [line.split("#", 1)[0].strip() for line in install.text.splitlines()]
    return [line for line in lines if line and not line.startswith("pip ")]


def _copy_package(dest: Path, built: bool) -> None:
    """The repository's files as a fresh clone has them (tracked or not ignored), and with ``built`` the
    native libraries built beside them, as a plain ``pip install .`` puts them in site-packages."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "infinity",
                             "setup.py", "pyproject.toml"], cwd=ROOT, capture_output=True, check=True).stdout
    files = [rel for rel in listed.decode().split("\0") if rel and (ROOT / rel).is_file()]
    if built:
        files += [str(p.relative_to(ROOT)) for p in (ROOT / "infinity").glob("*.so")]
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, dest / rel)


def test_install_checks_run_in_a_clone(tmp_path):
    """In a clone's root after ``pip install .``: the package is a folder of a site directory (a copy
    with the built libraries here, on a ``python -S`` path so that no editable install's finder
    serves it), and the clone's source folder sits in the current directory."""
    commands = install_checks(FOUND)
    assert commands, "the install block checks nothing after pip install"
    clone, site_dir = tmp_path / "clone", tmp_path / "site"
    _copy_package(clone, built=False)
    _copy_package(site_dir, built=True)
    if not list((site_dir / "infinity").glob("_aio_cffi*.so")):
        pytest.skip("the native libraries are not built in place here (no editable install)")
    import site
    path = os.pathsep.join([str(site_dir)] + site.getsitepackages())
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "python", command
        proc = subprocess.run([sys.executable, "-S"] + argv[1:], cwd=clone, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, f"`{command}` in a clone's root:\n{proc.stderr[-3000:]}"
        assert proc.stdout.split("\n", 1)[0] in ("io_uring", "threads"), proc.stdout


def test_blocks_and_the_skip_marker():
    text = "a\n\n```python\nx = 1\n```\n<!-- readme-test: skip -->\n\n```python\ny\n```\n```bash\n" \
           "python -m infinity.estimate --params 1B\n```\n```text\nfits\n...\n```\n"
    found = blocks(text)
    assert [(b.lang, b.line, b.skipped) for b in found] == [("python", 3, False), ("python", 8, True),
                                                            ("bash", 11, False), ("text", 14, False)]
    assert estimate_commands(found) == [("python -m infinity.estimate --params 1B", ["fits"])]
