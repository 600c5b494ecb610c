"""Deterministic execution and the environment fingerprint of a run.

Two runs are comparable only if everything but the hardware is the same: versions, backend,
device kind, XLA flags, the compiled program and its inputs. :func:`fingerprint` collects
those; :func:`fingerprint_differences` names what differs.

:func:`configure` must run before JAX creates its backend (XLA reads ``XLA_FLAGS`` once, at
that moment); the ``sdcguard record``/``compare`` commands call it first thing.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import warnings
from collections.abc import Mapping

import numpy as np

# GPU: deterministic reductions/scatters and no autotuning (autotuning may pick a different,
# equally valid, kernel on each run, with different rounding). XLA knows these flags on every
# backend, so they are harmless on CPU and TPU.
DETERMINISTIC_XLA_FLAGS = (
    "--xla_gpu_deterministic_ops=true",
    "--xla_gpu_exclude_nondeterministic_ops=true",
    "--xla_gpu_autotune_level=0",
)
PRNG_IMPL = "threefry2x32"

# Fingerprint fields that must match for two runs to be compared; the rest is informational.
COMPARED_FIELDS = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "backend",
    "device_kind",
    "xla_flags",
    "x64",
    "prng_impl",
    "matmul_precision",
    "hlo",
    "inputs",
)


def _backend_started() -> bool:
    import sys

    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(bridge is not None and getattr(bridge, "_backends", None))


def configure() -> str:
    """Sets the XLA flags of deterministic execution and pins the PRNG implementation.

    Returns:
      The resulting ``XLA_FLAGS``.

    Warns if JAX's backend already started on an accelerator (then the flags come too late
    for this process; the fingerprint records the flags in effect).
    """
    flags = os.environ.get("XLA_FLAGS", "").split()
    names = {f.split("=")[0] for f in flags}
    for flag in DETERMINISTIC_XLA_FLAGS:
        if flag.split("=")[0] not in names:
            flags.append(flag)
    if _backend_started():
        import jax

        if jax.default_backend() == "cpu":  # the flags do not affect CPU execution
            jax.config.update("jax_default_prng_impl", PRNG_IMPL)
            return os.environ.get("XLA_FLAGS", "")
        warnings.warn(
            "sdcguard.replay.configure() ran after JAX started its backend; "
            "the deterministic XLA flags apply only to new processes",
            stacklevel=2,
        )
    else:
        os.environ["XLA_FLAGS"] = " ".join(flags)
    import jax

    jax.config.update("jax_default_prng_impl", PRNG_IMPL)
    return os.environ.get("XLA_FLAGS", "")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def array_hash(x) -> str:
    """sha256 of an array's dtype, shape and bytes."""
    a = np.require(np.asarray(x), requirements="C")  # keeps 0-d arrays 0-d
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def tree_hash(tree) -> str:
    """sha256 over the leaves of a pytree, with their paths (order-independent of dict order)."""
    import jax

    h = hashlib.sha256()
    for path, leaf in sorted(
        (jax.tree_util.keystr(p), leaf) for p, leaf in jax.tree_util.tree_leaves_with_path(tree)
    ):
        h.update(path.encode())
        h.update(array_hash(leaf).encode())
    return h.hexdigest()


_METADATA = re.compile(r",? ?metadata=\{")


def _strip_metadata(line: str) -> str:
    # metadata={op_name="..." source_file="..."} holds paths and line numbers that differ
    # between installations without changing the program; remove it (braces may nest in quotes).
    out, pos = [], 0
    while (m := _METADATA.search(line, pos)) is not None:
        out.append(line[pos : m.start()])
        depth, i, quoted = 1, m.end(), False
        while i < len(line) and depth:
            c = line[i]
            if c == '"' and line[i - 1] != "\\":
                quoted = not quoted
            elif not quoted:
                depth += {"{": 1, "}": -1}.get(c, 0)
            i += 1
        pos = i
    out.append(line[pos:])
    return "".join(out)


def canonical_hlo(text: str) -> str:
    """Compiled HLO text without source locations (file names, lines, stack frames)."""
    lines, in_tables = [], False
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            in_tables = True
            continue
        if in_tables and (line.startswith(("%", "ENTRY")) or line.startswith("HloModule")):
            in_tables = False
        if in_tables:
            continue
        lines.append(_strip_metadata(line))
    return "\n".join(lines)


def hlo_hash(compiled) -> str:
    """Hash of a ``jax.stages.Compiled`` program's canonical HLO."""
    return _sha256(canonical_hlo(compiled.as_text()).encode())


def fingerprint(*, hlo: Mapping[str, str], inputs: Mapping[str, str]) -> dict:
    """The environment fingerprint of this process.

    Args:
      hlo: ``{program name: hlo_hash}`` of the compiled programs that ran.
      inputs: ``{input name: hash}`` (parameters, optimizer state, batches).

    Returns:
      A JSON-able dict; :data:`COMPARED_FIELDS` must match between comparable runs.
    """
    import flax
    import jax
    import jaxlib
    import optax

    device = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "x64": bool(jax.config.jax_enable_x64),
        "prng_impl": str(jax.config.jax_default_prng_impl),
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "hlo": dict(hlo),
        "inputs": dict(inputs),
        # Informational: where it ran.
        "host": platform.node(),
        "python": platform.python_version(),
        "device_count": jax.device_count(),
    }


def fingerprint_differences(a: Mapping, b: Mapping) -> list[str]:
    """Human-readable differences of the compared fields of two fingerprints (empty: same)."""
    diffs = []
    for field in COMPARED_FIELDS:
        va, vb = a.get(field), b.get(field)
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            # A program that only one run compiled (it ran fewer levels) is no difference.
            keys = set(va) & set(vb) if field == "hlo" else set(va) | set(vb)
            for key in sorted(keys):
                if va.get(key) != vb.get(key):
                    diffs.append(
                        f"{field}[{key}]: {_short(va.get(key))} (A) != {_short(vb.get(key))} (B)"
                    )
        elif va != vb:
            diffs.append(f"{field}: {_short(va)} (A) != {_short(vb)} (B)")
    return diffs


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
