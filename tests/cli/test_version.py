"""``sdcguard --version``: the installed version, read without importing the subcommands."""

import importlib.metadata
import subprocess
import sys

import pytest

from sdcguard import cli


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"sdcguard {importlib.metadata.version('sdcguard')}"


def test_version_imports_no_subcommand():
    # What `sdcguard --version` adds to `import sdcguard` (scripts/bench_import.py times both).
    code = (
        "import sys\nfrom sdcguard import cli\n"
        "try:\n    cli.main(['--version'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('sdcguard.cli.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
