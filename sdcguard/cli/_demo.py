"""``sdcguard demo``: its flags (the demo itself is :mod:`sdcguard.demo`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sdcguard._console import make_console
from sdcguard.cli._args import (
    add_command,
    check_output_dir,
    dtype_argument,
    error,
    positive_int,
)
from sdcguard.demo import DemoConfig, plot, print_result, run_demo
from sdcguard.models import GPTConfig
from sdcguard.training import COVERAGES, TrainConfig


def register(subparsers) -> None:
    """Adds ``demo`` to the ``sdcguard`` command line."""
    p = add_command(
        subparsers,
        "demo",
        _main,
        "train with injected faults, with and without ABFT",
        "Trains the reference GPT three times on built-in data (clean; with seven injected "
        "attention faults unprotected; the same faults under ABFT), prints the loss curves and "
        "counters, writes OUT/demo.png and OUT/demo.json. Exit 2 on bad options.",
    )
    for flag, kind, default, what in (
        (
            "--steps",
            positive_int,
            DemoConfig.steps,
            "training steps per run (default: %(default)s; faults after the last are dropped)",
        ),
        (
            "--out",
            Path,
            DemoConfig.out,
            "directory for demo.png and demo.json (default: %(default)s); checked first",
        ),
        (
            "--layers",
            positive_int,
            GPTConfig.num_layers,
            "transformer blocks of the reference GPT (default: %(default)s)",
        ),
    ):
        p.add_argument(flag, type=kind, default=default, help=what)
    p.add_argument(
        "--coverage",
        choices=COVERAGES,
        default=TrainConfig.coverage,
        help="attention: seven faults in attention GEMMs, the protected attention layers; "
        "every_gemm: seven faults in attention, projection, MLP and head GEMMs (forward and "
        "backward), every GEMM of the step checked by sdcguard.checked (default: %(default)s)",
    )
    p.add_argument(
        "--dtype",
        type=dtype_argument({"float32": "fp32", "bfloat16": "bf16"}),
        default=GPTConfig.dtype,
        help="computation dtype: float32 or bfloat16 (fp32, bf16 also accepted; default "
        "%(default)s)",
    )


def _main(args: argparse.Namespace) -> int:
    console = make_console()
    try:
        model = GPTConfig(num_layers=args.layers, dtype=args.dtype)
        train = TrainConfig(model=model, coverage=args.coverage)
        config = DemoConfig(steps=args.steps, out=args.out, train=train)
        check_output_dir(config.out, "--out")  # before minutes of training, not after
        result = run_demo(config, console)
        print_result(result, console)
        (config.out / "demo.json").write_text(json.dumps(result, indent=1))
        plot(result, config.out / "demo.png")
    except KeyboardInterrupt:
        return error("interrupted", 130)
    except OSError as e:
        return error(f"{e.strerror or type(e).__name__}: {e.filename}")
    except ValueError as e:
        return error(str(e))
    console.print(f"wrote {config.out / 'demo.png'} and {config.out / 'demo.json'}")
    return 0
