"""The documentation cannot rot: README.md and docs/*.md run, and the docs build strictly.

- Every ```python block of a page runs, in order, in one namespace per page (a later block may
  use an earlier block's names), in a temporary working directory.
- Every ```bash block is checked without running its jobs: each ``sdcguard ...`` command line is
  parsed by ``sdcguard.cli.build_parser()``, each ``python scripts/X.py --flag ...`` names a
  script that exists and flags that script defines, and the README's test command is the one
  ``.ci/run`` runs.
- ```text blocks are prose (layouts, output); no other language is allowed, so a new block is
  either checked or marked as not runnable on purpose.
- ``mkdocs build --strict`` (warnings are errors) succeeds.

A page that starts with ``<!-- docs-test: 8 devices -->`` runs in a subprocess that sees 8 CPU
devices (its examples shard over them), like the other ``on_8_devices`` tests.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sdcguard import cli

from tests.helpers.multidevice import needs_8, run_on_8_devices

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
EIGHT_DEVICES = "<!-- docs-test: 8 devices -->"
LANGUAGES = {"python", "bash", "text"}
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


def blocks(page: Path) -> list[tuple[str, int, str]]:
    """``(language, first line, code)`` of every fenced block of ``page``."""
    text = page.read_text()
    return [
        (m.group(1), text.count("\n", 0, m.start()) + 2, m.group(2)) for m in FENCE.finditer(text)
    ]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def _needs_8(page: Path) -> bool:
    return page.read_text().startswith(EIGHT_DEVICES)


def run_page(page: Path) -> dict:
    """Runs the python blocks of ``page`` in order in one namespace; returns the namespace."""
    namespace = {"__name__": f"docs:{_name(page)}"}
    for language, line, code in blocks(page):
        if language == "python":
            # Padding with newlines makes a traceback point at the line in the page.
            exec(compile("\n" * (line - 1) + code, _name(page), "exec"), namespace)
    return namespace


# --- Shell blocks -------------------------------------------------------------------------------


def _commands(code: str) -> list[list[str]]:
    """The command lines of a shell block as argv lists (``&&``, ``;`` and ``|`` split them)."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        argv: list[str] = []
        for token in shlex.split(line, comments=True):
            if token in ("&&", "||", ";", "|"):
                commands.append(argv)
                argv = []
            else:
                argv.append(token)
        commands.append(argv)
    return [c for c in map(_without_environment, commands) if c]


def _without_environment(argv: list[str]) -> list[str]:
    """``argv`` less its leading ``VAR=value`` assignments (the command's environment)."""
    i = 0
    while i < len(argv) and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[i]):
        i += 1
    return argv[i:]


def _script_flags(script: Path) -> set[str]:
    """Every ``--flag`` string constant of a script (what its argparse parser can accept)."""
    tree = ast.parse(script.read_text())
    return {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("--")
    }


def check_command(argv: list[str], page: Path) -> None:
    """Fails when a documented command would not run as written (parsing only)."""
    if argv[0] == "sdcguard":
        try:
            cli.build_parser().parse_args(argv[1:])
        except SystemExit as e:
            pytest.fail(f"{_name(page)}: `{shlex.join(argv)}` does not parse (exit {e.code})")
    elif argv[0] in ("python", "python3") and len(argv) > 1 and argv[1].endswith(".py"):
        script = ROOT / argv[1]
        assert script.is_file(), f"{_name(page)}: `{shlex.join(argv)}`: no such script"
        flags = {a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")}
        unknown = flags - _script_flags(script)
        assert not unknown, f"{_name(page)}: {argv[1]} has no option {sorted(unknown)}"
    elif argv[:3] in (["python", "-m", "pytest"], ["python3", "-m", "pytest"]):
        # The first pytest command of .ci/run is the one every full environment runs.
        ci = [c for c in _commands((ROOT / ".ci/run").read_text()) if c[1:3] == ["-m", "pytest"]]
        assert ci and argv[1:] == ci[0][1:], (
            f"{_name(page)}: the test command `{shlex.join(argv)}` is not the one .ci/run runs"
        )


# --- Tests --------------------------------------------------------------------------------------


def test_pages_exist():
    names = {_name(p) for p in PAGES}
    assert {"README.md", "docs/index.md", "docs/performance.md", "docs/architecture.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_blocks_are_marked(page):
    unknown = [(line, lang) for lang, line, _ in blocks(page) if lang not in LANGUAGES]
    assert not unknown, (
        f"{_name(page)}: code blocks at {unknown} are neither python, bash nor text; mark a "
        "block that is not meant to run as ```text"
    )


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_shell_commands_parse(page):
    for language, _, code in blocks(page):
        if language == "bash":
            for argv in _commands(code):
                check_command(argv, page)


@pytest.mark.parametrize("page", [p for p in PAGES if not _needs_8(p)], ids=_name)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_page(page)


def test_8_device_pages():
    """Runs this file's ``on_8_devices`` tests in a process that sees 8 CPU devices."""
    if not any(_needs_8(p) for p in PAGES):
        pytest.skip("no page needs 8 devices")
    run_on_8_devices(__file__)


@needs_8
@pytest.mark.parametrize("page", [p for p in PAGES if _needs_8(p)], ids=_name)
def test_python_blocks_run_on_8_devices(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_page(page)


def test_docs_build_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[test]' installs it")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (tmp_path / "api" / "protection" / "index.html").is_file()


# --- The checker itself can fail -----------------------------------------------------------------


def test_a_wrong_command_is_caught(tmp_path):
    page = tmp_path / "page.md"
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        check_command(["sdcguard", "campaign", "--no-such-flag"], page)
    with pytest.raises(AssertionError, match="has no option"):
        check_command(["python", "scripts/bench_guard.py", "--no-such-flag"], ROOT / "README.md")
    with pytest.raises(AssertionError, match=r"not the one \.ci/run runs"):
        check_command(["python", "-m", "pytest", "-q"], ROOT / "README.md")
    assert _commands("A=1 sdcguard demo --steps 3 && python -m pytest -q  # note\n") == [
        ["sdcguard", "demo", "--steps", "3"],
        ["python", "-m", "pytest", "-q"],
    ]


def test_a_broken_example_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nassert x == 2, 'x is not 2'\n```\n")
    with pytest.raises(AssertionError, match="x is not 2"):
        run_page(page)
