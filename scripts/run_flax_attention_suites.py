"""Runs Flax's own attention test suites with sdcguard's protected layers swapped in.

Flax's ``tests/linen/linen_attention_test.py`` and ``tests/nnx/nn/attention_test.py`` are read
from a Flax checkout (a work tree, or a git directory with ``--rev``), copied to a temporary
directory and run with pytest; nothing of Flax's is copied into this repository. Modes:

  ``dropin``  ``flax.linen.MultiHeadDotProductAttention`` / ``MultiHeadAttention`` /
              ``SelfAttention`` and ``flax.nnx.MultiHeadAttention`` are replaced by the classes
              of ``sdcguard.linen`` / ``sdcguard.nnx`` for the whole run.
  ``protect`` every linen test runs inside ``sdcguard.linen.protect()`` (Flax's own classes,
              intercepted), and every ``nnx.MultiHeadAttention`` is passed through
              ``sdcguard.nnx.protect`` as soon as it is constructed.
  ``none``    Flax unchanged (the baseline).

Every test that constructs an attention layer must then run on the protected one: the run
fails if a swapped class was never instantiated.

    python scripts/run_flax_attention_suites.py /path/to/flax            # a checkout
    python scripts/run_flax_attention_suites.py /path/to/flax.git --rev v0.12.8 --mode protect

Prints passed/failed per file and writes JSON (``--json``). Needs ``absl-py`` (Flax's tests
use ``absltest``). ``--bit-identity`` (no suites) compares the clean outputs of the drop-ins with
Flax's layers over dtypes, grouped KV heads, decoding and masks.

    python scripts/run_flax_attention_suites.py --bit-identity
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SUITES = ("tests/linen/linen_attention_test.py", "tests/nnx/nn/attention_test.py")
MODES = ("dropin", "protect", "none")


def extract_suites(flax: Path, rev: str | None, into: Path) -> list[Path]:
    """Copies the two test files from a Flax work tree, or from ``rev`` of a git directory."""
    paths = []
    for suite in SUITES:
        target = into / Path(suite).name
        if rev is None and (flax / suite).is_file():
            target.write_text((flax / suite).read_text())
        else:
            text = subprocess.run(
                ["git", "--git-dir", str(_git_dir(flax)), "show", f"{rev or 'HEAD'}:{suite}"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            target.write_text(text)
        paths.append(target)
    return paths


def _git_dir(flax: Path) -> Path:
    return flax / ".git" if (flax / ".git").exists() else flax


def _commit(git_dir: Path, rev: str = "HEAD") -> str | None:
    try:
        return subprocess.run(
            ["git", "--git-dir", str(git_dir), "rev-parse", rev],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


class Swap:
    """A pytest plugin that swaps the protected layers in and tallies the outcomes."""

    def __init__(self, mode: str):
        self.mode = mode
        self.outcomes: dict[str, str] = {}
        self.constructed = 0
        self._undo: list = []

    # -- the swap ------------------------------------------------------------------------------

    def _patch(self, owner, name, value):
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def pytest_sessionstart(self, session):
        import flax.linen as nn
        from flax import nnx

        from sdcguard import linen as sl, nnx as snnx

        plugin = self
        if self.mode == "dropin":
            counted = {}
            for name, cls in (
                ("MultiHeadDotProductAttention", sl.MultiHeadDotProductAttention),
                ("MultiHeadAttention", sl.MultiHeadAttention),
                ("SelfAttention", sl.SelfAttention),
            ):
                counted[name] = _counting(cls, plugin)
                self._patch(nn, name, counted[name])
            self._patch(nnx, "MultiHeadAttention", _counting(snnx.MultiHeadAttention, plugin))
        elif self.mode == "protect":
            original = nnx.MultiHeadAttention

            class ProtectedOnConstruction(original):
                def __init__(self, *args, **kwargs):
                    super().__init__(*args, **kwargs)
                    snnx.protect(self)
                    plugin.constructed += 1

            self._patch(nnx, "MultiHeadAttention", ProtectedOnConstruction)

    def pytest_sessionfinish(self, session):
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        if self.mode != "protect" or "linen" not in item.path.name:
            return (yield)
        import flax.linen as nn

        from sdcguard import linen as sl

        plugin = self

        def count(next_fun, args, kwargs, context):
            if context.method_name == "__call__" and isinstance(
                context.module, nn.MultiHeadDotProductAttention
            ):
                plugin.constructed += 1
            return next_fun(*args, **kwargs)

        with sl.protect(), nn.intercept_methods(count):
            return (yield)

    def pytest_runtest_teardown(self, item):
        import jax

        # Every test compiles its own programs; without this the process grows by GBs.
        jax.clear_caches()

    # -- the tally -----------------------------------------------------------------------------

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            previous = self.outcomes.get(report.nodeid)
            if previous in (None, "passed"):
                self.outcomes[report.nodeid] = report.outcome


def _counting(cls, plugin):
    """``cls`` with a constructor that counts its instances (to show the swap took effect)."""

    if hasattr(cls, "__dataclass_fields__") and hasattr(cls, "setup"):  # a linen module

        class Counted(cls):
            def __post_init__(self):
                plugin.constructed += 1
                super().__post_init__()

    else:

        class Counted(cls):
            def __init__(self, *args, **kwargs):
                plugin.constructed += 1
                super().__init__(*args, **kwargs)

    Counted.__name__ = Counted.__qualname__ = cls.__name__
    Counted.__module__ = cls.__module__
    return Counted


# --- Clean outputs against Flax's, bit for bit ----------------------------------------------------


def bit_identity_survey() -> list[dict]:
    """Clean outputs of the drop-ins against Flax's layers over dtypes, grouped KV heads, decode,
    masks and the NNX core's two paths (its own einsums with sow/dropout, jax.nn otherwise)."""
    import itertools

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sdcguard import linen as sl, nnx as snnx

    dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
    rows = []

    def row(layer, config, ours, theirs):
        diff = jnp.max(jnp.abs(ours.astype(jnp.float32) - theirs.astype(jnp.float32)))
        identical = bool(jnp.all(ours == theirs))
        rows.append(dict(layer=layer, **config, identical=identical, max_abs_diff=float(diff)))

    for dtype, precision, decode, normalize_qk in itertools.product(
        dtypes, (None, jax.lax.Precision.HIGHEST), (False, True), (False, True)
    ):
        kw = dict(num_heads=2, qkv_features=8, dtype=dtype, precision=precision, decode=decode)
        kw["normalize_qk"] = normalize_qk
        x = jax.random.normal(jax.random.key(0), (2, 5, 4))
        theirs, ours = nn.MultiHeadDotProductAttention(**kw), sl.MultiHeadDotProductAttention(**kw)
        v = theirs.init(jax.random.key(1), x)
        x = x[:, :1] if decode else x
        config = dict(dtype=jnp.dtype(dtype).name, kv_heads="all", decode=decode)
        config.update(call=f"precision={precision}, normalize_qk={normalize_qk}")
        row(
            "linen",
            config,
            ours.apply(v, x, mutable=["cache"])[0],
            theirs.apply(v, x, mutable=["cache"])[0],
        )
    calls = ("plain", "mask", "causal", "sow_weights", "dropout_deterministic")
    for dtype, kv_heads, decode, call in itertools.product(dtypes, (None, 2), (False, True), calls):
        if decode and call != "plain":
            continue
        kw = dict(num_heads=4, in_features=8, num_kv_heads=kv_heads, dtype=dtype, decode=decode)
        kw["dropout_rate"] = 0.3 if call == "dropout_deterministic" else 0.0
        x = jax.random.normal(jax.random.key(0), (2, 5, 8))
        classes = (snnx.MultiHeadAttention, nnx.MultiHeadAttention)
        layers = [cls(rngs=nnx.Rngs(0), **kw) for cls in classes]
        args = {
            "mask": dict(mask=nnx.make_attention_mask(jnp.ones((2, 5)), jnp.arange(5) < 3)),
            "causal": dict(is_causal=True),
            "sow_weights": dict(sow_weights=True),
            "dropout_deterministic": dict(deterministic=True),
        }.get(call, {})
        if decode:
            for layer in layers:
                layer.init_cache(x.shape, dtype=dtype)
            x = x[:, :1]
        config = dict(dtype=jnp.dtype(dtype).name, kv_heads=kv_heads or "all", decode=decode)
        row("nnx", dict(config, call=call), *(layer(x, **args) for layer in layers))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("flax", type=Path, nargs="?", help="a Flax checkout or git directory")
    parser.add_argument("--rev", help="a git revision to read the suites from (default: work tree)")
    parser.add_argument("--mode", choices=MODES, default="dropin")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("-v", dest="verbose", action="store_true", help="name each test as it runs")
    parser.add_argument("--json", type=Path, help="write the outcomes here")
    parser.add_argument(
        "--bit-identity",
        action="store_true",
        help="instead of the suites: compare clean outputs with Flax's layers, bit for bit",
    )
    args = parser.parse_args(argv)
    if args.bit_identity:
        rows = bit_identity_survey()
        for r in rows:
            verdict = "identical" if r["identical"] else f"max |diff| {r['max_abs_diff']:.3g}"
            print(
                f"{r['layer']:5s} {r['dtype']:8s} kv_heads={r['kv_heads']!s:3s} "
                f"decode={r['decode']!s:5s} {r['call']:40s} {verdict}"
            )
        print(f"{sum(r['identical'] for r in rows)} of {len(rows)} configurations bit-identical")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return 0

    if args.flax is None:
        parser.error("give the path of a Flax checkout (or --bit-identity)")
    with tempfile.TemporaryDirectory() as tmp:
        files = extract_suites(args.flax, args.rev, Path(tmp))
        plugin = Swap(args.mode)
        verbosity = "-v" if args.verbose else "-q"
        pytest_args = [*map(str, files), verbosity, "-p", "no:cacheprovider", "--rootdir", tmp]
        if args.keyword:
            pytest_args += ["-k", args.keyword]
        pytest.main(pytest_args, plugins=[plugin])

    outcomes = plugin.outcomes
    passed = sorted(k for k, v in outcomes.items() if v == "passed")
    failed = sorted(k for k, v in outcomes.items() if v != "passed")
    print(f"\nmode={args.mode}: {len(passed)} passed, {len(failed)} failed of {len(outcomes)}")
    for suite in SUITES:
        name = Path(suite).name
        n_pass = sum(k.startswith(name) for k in passed)
        n_all = sum(k.startswith(name) for k in outcomes)
        print(f"  {name}: {n_pass}/{n_all}")
    for nodeid in failed:
        print(f"  {outcomes[nodeid].upper()} {nodeid}")
    swapped = args.mode == "none" or plugin.constructed > 0
    if not swapped:
        print("  the protected layers were never constructed: the swap did not take effect")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "mode": args.mode,
                    "flax_tests_from": args.rev or str(args.flax),
                    "flax_commit": _commit(_git_dir(args.flax), args.rev or "HEAD"),
                    "sdcguard_commit": _commit(Path(__file__).resolve().parents[1] / ".git"),
                    "passed": len(passed),
                    "failed": failed,
                    "total": len(outcomes),
                    "protected_layers_constructed": plugin.constructed,
                },
                indent=2,
            )
        )
    return 0 if not failed and swapped and outcomes else 1


if __name__ == "__main__":
    sys.exit(main())
