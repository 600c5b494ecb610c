"""Helpers shared by the tests: tolerances, models, multi-device and replay fixtures."""

from pathlib import Path

HELPERS = Path(__file__).parent
REPLAY_LAUNCHER = HELPERS / "replay_launcher.py"  # a stand-in for `ssh {node}`
MULTIPROCESS_WORKER = HELPERS / "multiprocess_worker.py"  # one process of a 2-process job
