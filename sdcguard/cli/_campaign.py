"""``sdcguard campaign``: the command line of fault campaigns (flags -> :class:`CampaignConfig`).

Every flag is checked before anything runs or is written: numbers by their argument types
(``argument --trials: must be >= 1, got 0``), ``--bits`` against the dtype, ``--sites`` against
the model's sites (an unknown one is named with its close matches; ``--list-sites`` prints them
all), ``--out`` by writing in it. Exit codes: 0 done, 2 bad options (one line on stderr, no
traceback), 130 interrupted (the finished trials are kept; the same command resumes).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from sdcguard._console import make_console
from sdcguard.campaign import (
    DTYPE_BITS,
    DTYPES,
    OUTPUT_GROUPS,
    PROTECTIONS,
    RESULTS_FILE,
    CampaignConfig,
    CampaignFileError,
    UnknownSiteError,
    print_summary,
    run_campaign,
)
from sdcguard.cli._args import (
    add_command,
    check_output_dir,
    dtype_argument,
    error,
    integer,
    non_negative_int,
    positive_int,
)
from sdcguard.fault_model import FAULT_KINDS
from sdcguard.models import GPTConfig
from sdcguard.training import COVERAGES, MODEL_KINDS

# Either spelling of a dtype (``bf16`` or ``bfloat16``, as ``sdcguard demo`` takes it).
_dtype = dtype_argument(DTYPES)


def register(subparsers) -> None:
    """Adds ``campaign`` to the ``sdcguard`` command line."""
    p = add_command(
        subparsers,
        "campaign",
        _main,
        "fault-injection campaign with/without protection",
        "Injects one fault per trial into real training, for every site x kind x trial of the "
        "grid and every protection level, and reports harm, detection and correction. Results "
        "are appended per trial to OUT/trials.jsonl: rerun the same command to resume (after "
        "Ctrl-C, exit 130). Exit 2 on bad options (the error on stderr, no traceback), among "
        "them an OUT holding trials of another grid.",
    )
    d = CampaignConfig()

    def add_list(flag: str, nargs: str, default: tuple, what: str, **kind) -> None:
        """A flag of several values (``kind``: their type or choices); ``default``: a tuple."""
        p.add_argument(
            flag, nargs=nargs, default=list(default), help=f"{what} (default: %(default)s)", **kind
        )

    p.add_argument(
        "--out",
        type=Path,
        default=d.out,
        help="output directory: trials.jsonl, summary.md, campaign.json, figures "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--model",
        choices=MODEL_KINDS,
        default=d.model_kind,
        help="gpt: decoder, next-byte loss; encoder: bidirectional, masked-byte loss",
    )
    p.add_argument(
        "--coverage",
        choices=COVERAGES,
        default=d.coverage,
        help="what ABFT checks and where faults go: the attention layers, or every GEMM of "
        "the step (attention, projections, MLP, head; forward and backward) under "
        "sdcguard.checked (default: %(default)s)",
    )
    for flag, default, what in (
        ("--layers", d.model.num_layers, "transformer blocks"),
        ("--d-model", d.model.d_model, "model width"),
        ("--heads", d.model.num_heads, "attention heads"),
        ("--seq-len", d.model.seq_len, "tokens per sequence"),
        ("--batch-size", d.batch_size, "sequences per batch"),
    ):
        p.add_argument(flag, type=positive_int, default=default, help=f"{what} (%(default)s)")
    p.add_argument(
        "--sites",
        nargs="*",
        default=[],
        help="site names or patterns ('*' within one path component, '**' across, as for "
        "every --sites of sdcguard): GEMM sites of the coverage (fwd and bwd, e.g. "
        "'decoder/block_0/attn:scores.grad_lhs', or with --coverage every_gemm "
        "'decoder/**/mlp/*'), and module outputs (forward, e.g. "
        "'decoder/block_*/mlp:output'); default: every GEMM site of the coverage. Parameter sites "
        "('...:kernel.grad') are injected by sdcguard compare/record only",
    )
    p.add_argument(
        "--output-sites",
        action="store_true",
        help="also inject at every block's and MLP's output ("
        + ", ".join(OUTPUT_GROUPS).replace("{stack}", "decoder|encoder")
        + ")",
    )
    add_list("--kinds", "+", d.kinds, "fault kinds", choices=FAULT_KINDS)
    p.add_argument(
        "--bits",
        type=integer,
        nargs=2,
        metavar=("LO", "HI"),
        default=None,
        help="bitflip bit range (inclusive, below the dtype's width); default: the dtype's "
        "exponent bits",
    )
    p.add_argument(
        "--value",
        type=float,
        default=d.value,
        help="the value set by 'value' faults, the factor of 'scale' faults (%(default)s)",
    )
    for flag, kind, default, what in (
        ("--trials", positive_int, d.trials, "trials per site and kind"),
        ("--seed", integer, d.seed, "seed of parameters, data, trials"),
        ("--warmup", non_negative_int, d.warmup, "clean steps before the fault step"),
        ("--steps-after", positive_int, d.steps_after, "steps trained after the fault"),
        (
            "--fp-steps",
            non_negative_int,
            d.fp_steps,
            "clean ABFT steps per dtype for the false-positive count (0: skip)",
        ),
        (
            "--propagation-trials",
            non_negative_int,
            d.propagation_trials,
            "faults per forward site and kind of the propagation study (0: skip)",
        ),
    ):
        p.add_argument(flag, type=kind, default=default, help=f"{what} (default: %(default)s)")
    p.add_argument(
        "--dtype",
        type=_dtype,
        default=d.dtype,
        help="computation dtype: fp32, bf16 or fp16 (float32, bfloat16, float16 also accepted; "
        "default %(default)s)",
    )
    add_list("--protection", "+", d.protections, "protection levels to run", choices=PROTECTIONS)
    add_list("--fp-dtypes", "*", d.fp_dtypes, "dtypes of the false-positive count", type=_dtype)
    p.add_argument(
        "--max-trials",
        type=positive_int,
        default=None,
        help="stop after this many new trials, taken so that every protection and fault kind "
        "is sampled about evenly (resume later with the same command)",
    )
    p.add_argument(
        "--list-sites",
        action="store_true",
        help="print the sites of the model (every site, or those --sites and --output-sites "
        "select; with --model, --layers and --coverage as given) and exit",
    )


def check_bits(bits: list[int] | None, dtype: str) -> None:
    """``--bits LO HI``: an inclusive range of bit positions of the dtype's bit pattern.

    Raises:
      ValueError: one line naming ``--bits``, what is wrong and what to give.
    """
    if not bits:
        return
    lo, hi = bits
    width = DTYPE_BITS[dtype]
    if not 0 <= lo <= hi:
        raise ValueError(
            f"--bits {lo} {hi}: give the lower bit first, both from 0 (e.g. --bits "
            f"{min(lo, hi)} {max(lo, hi)}); bits of {dtype} are 0 to {width - 1}"
        )
    if hi >= width:
        raise ValueError(
            f"--bits {lo} {hi}: bit range ({lo}, {hi}) does not fit {dtype} (bits 0 to "
            f"{width - 1}); give HI <= {width - 1}"
        )


def config_from_args(args: argparse.Namespace) -> CampaignConfig:
    """The campaign the parsed flags describe.

    Raises:
      ValueError: flags that no campaign can have (``--bits`` outside the dtype...).
    """
    check_bits(args.bits, args.dtype)
    model = dataclasses.replace(
        GPTConfig(),
        num_layers=args.layers,
        d_model=args.d_model,
        num_heads=args.heads,
        seq_len=args.seq_len,
    )
    return CampaignConfig(
        model=model,
        model_kind=args.model,
        coverage=args.coverage,
        batch_size=args.batch_size,
        sites=tuple(args.sites),
        include_outputs=args.output_sites,
        kinds=tuple(args.kinds),
        bit_range=tuple(args.bits) if args.bits else None,
        value=args.value,
        trials=args.trials,
        seed=args.seed,
        dtype=args.dtype,
        protections=tuple(args.protection),
        warmup=args.warmup,
        steps_after=args.steps_after,
        fp_steps=args.fp_steps,
        fp_dtypes=tuple(args.fp_dtypes),
        propagation_trials=args.propagation_trials,
        out=args.out,
    )


def _list_sites(config: CampaignConfig) -> int:
    sites = config.site_list() if config.sites or config.include_outputs else config.valid_sites()
    for site in sites:
        print(site)
    print(f"{len(sites)} sites", file=sys.stderr)
    return 0


def _main(args: argparse.Namespace) -> int:
    console = make_console()
    try:
        config = config_from_args(args)
        if args.list_sites:
            return _list_sites(config)
        config.site_list()  # unknown sites fail before anything is created
        check_output_dir(config.out, "--out")
        result = run_campaign(
            config,
            console,
            max_trials=args.max_trials,
            command=shlex.join(["sdcguard", *sys.argv[1:]]),
        )
    except KeyboardInterrupt:
        done = Path(args.out) / RESULTS_FILE
        return error(
            f"interrupted; the finished trials are in {done}: rerun the same command to resume",
            130,
        )
    except OSError as err:
        return error(f"{err.strerror or type(err).__name__}: {err.filename}")
    except UnknownSiteError as err:
        return error(f"--sites {err}")
    except (ValueError, CampaignFileError) as err:
        return error(str(err))
    print_summary(result, console)
    console.print(
        f"wrote {config.out / 'summary.md'}, campaign.json, {RESULTS_FILE} and "
        f"{len(result['figures'])} figures"
    )
    return 0
