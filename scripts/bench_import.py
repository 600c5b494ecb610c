"""What starting sdcguard costs: ``import sdcguard`` and ``sdcguard --version``, cold processes.

Each command runs in a fresh Python process, in interleaved rounds (``import jax`` alone as the
floor every JAX library pays), and the median wall time per command is reported, with what
``import sdcguard`` loads of the heavy optional dependencies (none is expected).

    python scripts/bench_import.py              # 9 rounds
    python scripts/bench_import.py --rounds 21 --out runs/bench_import.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from timing import interleaved

# Extras, imported where they are used (tests/test_package.py pins that they stay unloaded).
HEAVY = ("orbax", "zfec", "matplotlib")


def commands() -> dict[str, list[str]]:
    """The timed commands, each a process of its own."""
    cli = shutil.which("sdcguard")
    version = [cli, "--version"] if cli else [sys.executable, "-m", "sdcguard", "--version"]
    return {
        "import jax": [sys.executable, "-c", "import jax"],
        "import sdcguard": [sys.executable, "-c", "import sdcguard"],
        "sdcguard --version": version,
    }


def timer(argv: list[str]):
    def run() -> float:
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        return time.perf_counter() - start

    return run


def heavy_modules_loaded() -> list[str]:
    """The heavy optional dependencies that ``import sdcguard`` loads (none expected)."""
    code = (
        "import sys, sdcguard\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.replace("'", '"'))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    argvs = commands()
    timer(argvs["import sdcguard"])()  # warm the file cache: every round then reads it alike
    seconds = interleaved({name: timer(argv) for name, argv in argvs.items()}, args.rounds)
    result = {
        "python": sys.version.split()[0],
        "rounds": args.rounds,
        "median_seconds": {name: float(np.median(s)) for name, s in seconds.items()},
        "seconds": seconds,
        "heavy_modules_loaded": heavy_modules_loaded(),
    }
    for name, median in result["median_seconds"].items():
        spread = f"{min(seconds[name]):.2f}-{max(seconds[name]):.2f}"
        print(f"{name:20s} median {median:.2f} s  (range {spread} s, {args.rounds} rounds)")
    print(f"heavy optional modules loaded by import sdcguard: {result['heavy_modules_loaded']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
