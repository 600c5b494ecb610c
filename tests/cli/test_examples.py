"""Every command-line example in ``--help`` and in the docs is run or checked here.

The ``sdcguard`` lines of the docs' shell blocks are parsed and put through every check that
runs before work starts (campaign: the configuration and its sites; replay: nodes and fault
specs); the cheap ones (``--list-sites``) run whole. The site patterns that ``--help`` quotes
must each select something, under the one grammar that ``ABFTConfig(include=...)`` shares.
"""

import argparse
import re
import shlex
from pathlib import Path

import pytest

from sdcguard import cli
from sdcguard.campaign import CampaignConfig
from sdcguard.cli import _campaign
from sdcguard.fault_model import match_sites, parse_spec, site_matches
from sdcguard.replay import task_sites
from sdcguard.replay._nodes import parse_node

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/campaigns.md", "docs/replay.md", "docs/index.md")


def _shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced ``bash``/``sh`` blocks of a markdown text."""
    blocks, body, lang = [], None, None
    for line in text.splitlines():
        if line.startswith("```"):
            if body is None:
                body, lang = [], line[3:].strip()
            else:
                if lang in ("bash", "sh", "shell", "console"):
                    blocks.append("\n".join(body))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def _doc_commands() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` of every ``sdcguard ...`` command of the docs' shell blocks."""
    out = []
    for doc in DOCS:
        for block in _shell_blocks((ROOT / doc).read_text()):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():  # continuation lines
                for part in re.split(r"&&|;", line):
                    argv = shlex.split(part, comments=True)
                    if "sdcguard" in argv:
                        argv = argv[argv.index("sdcguard") + 1 :]
                        out.append((f"{doc}: {' '.join(part.split('#')[0].split())}", argv))
    return out


COMMANDS = _doc_commands()


def test_the_docs_have_examples_of_every_subcommand():
    seen = {argv[0] for _, argv in COMMANDS if argv}
    assert {"demo", "campaign", "compare", "scan", "sites", "record"} <= seen


def _help(command: str) -> str:
    parser = cli.build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command].format_help()


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_doc_command_passes_every_check_before_running(where, argv, capsys):
    args = cli.build_parser([argv[0]]).parse_args(argv)
    if argv[0] == "campaign":
        config = _campaign.config_from_args(args)
        assert config.site_list()
        if args.list_sites:
            assert args.handler(args) == 0
            assert len(capsys.readouterr().out.splitlines()) == len(config.valid_sites())
    elif argv[0] in ("compare", "scan"):
        nodes = args.nodes if argv[0] == "scan" else [args.node_a, args.node_b]
        for node in nodes:
            parse_node(node)
        for spec in getattr(args, "inject_b", []):
            fault = parse_spec(spec)
            assert fault.site in task_sites("sdcguard.replay:reference_task")[0]


def _quoted(text: str) -> list[str]:
    return re.findall(r"'([^' ]+)'", " ".join(text.split()))


def test_campaign_help_site_examples_select_sites():
    text = _help("campaign")
    section = text[text.index("\n  --sites") : text.index("\n  --output-sites")]
    examples = [e for e in _quoted(section) if "/" in e]
    assert "decoder/**/mlp/*" in examples and len(examples) >= 3
    for coverage in ("every_gemm",):
        valid = CampaignConfig(coverage=coverage).valid_sites()
        for pattern in examples:
            assert match_sites(pattern, valid), (pattern, coverage)
    # The --help example runs as a campaign grid: the MLP GEMMs, forward and backward.
    config = CampaignConfig(coverage="every_gemm", sites=("decoder/**/mlp/*",))
    assert config.site_list() and all("/mlp/" in s for s in config.site_list())


def test_replay_help_site_examples_select_modules():
    text = _help("compare")
    section = text[text.index("\n  --sites") :]
    examples = [e for e in _quoted(section) if e.startswith("decoder/")][:2]
    assert examples == ["decoder/block_*/mlp", "decoder/**"]
    for pattern in examples:
        names, modules = task_sites("sdcguard.replay:reference_task", pattern)
        assert names and modules


@pytest.mark.parametrize(
    "pattern, name, selected",
    [
        ("decoder/**/mlp/*", "decoder/block_0/mlp/fc_in:dot_general.grad_rhs", True),
        ("decoder/block_*:output", "decoder/block_0/mlp:output", False),
        ("decoder/block_*:output", "decoder/block_0:output", True),
        ("**attn**", "layers[0].attn:scores", True),
        ("**layers[1].**", "layers[1].mlp.layers[0]:dot_general", True),
        ("*attn*", "decoder/block_0/attn:scores", False),  # '*' stops at '/'
        ("**", "embed:attend.grad_lhs", True),
        ("**grad**", "stack_loss/layer/<lambda>:dot_general.grad_rhs", True),  # a whole name
        ("decoder/**/mlp", "decoder/block_0/mlp:output", True),  # a module path
    ],
)
def test_one_grammar_for_sites_and_abft_include(pattern, name, selected):
    from sdcguard.protection import ABFTConfig
    from sdcguard.protection._select import _selected

    assert site_matches(pattern, name) is selected
    assert _selected(name, ABFTConfig(include=(pattern,))) is selected  # the same answer
    assert _selected(name, ABFTConfig(exclude=(pattern,))) is not selected
