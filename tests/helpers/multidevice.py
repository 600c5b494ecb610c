"""Running a test file's ``on_8_devices`` tests in a subprocess that sees 8 CPU devices.

The device count is fixed when JAX starts, so the main test process (one CPU device) re-runs
those tests in a child process with ``--xla_force_host_platform_device_count=8``.
"""

import os
import subprocess
import sys

import jax
import pytest

EIGHT = "--xla_force_host_platform_device_count=8"
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="runs in a subprocess with 8 devices")


def run_on_8_devices(test_file: str) -> str:
    """Runs ``test_file -k on_8_devices`` with 8 CPU devices; returns pytest's output."""
    if jax.device_count() >= 8:
        pytest.skip("this process already has 8 devices: the tests run directly")
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {EIGHT}".strip()}
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            test_file,
            "-k",
            "on_8_devices",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout
