"""Where a compiled step's device time goes: a JAX profiler trace, summed per HLO instruction.

:func:`profile` runs a compiled function under ``jax.profiler.trace`` and :func:`summarize`
reads the Perfetto trace it writes: the device time per call, the kernels per call, the host's
launch calls (a step whose kernels run from CUDA graphs makes few; one that launches each
kernel makes one per kernel), and the instructions that take most of the time, each with the
JAX operation it came from (its ``op_name`` in the compiled HLO), and the device time of the
checks (instructions under :data:`sdcguard.protection.CHECK_SCOPE`) per layer and direction.
On a GPU the events are the kernels on the device's streams; on the CPU, XLA's thunks.

    >>> step = jax.jit(f).lower(x).compile()
    >>> summary = profile(lambda: step(x), step.as_text(), Path("runs/trace"), calls=2)
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from collections.abc import Callable
from pathlib import Path

import jax

from sdcguard.protection import CHECK_SCOPE

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_CONTROL_FLOW = re.compile(r" (while|conditional|call)\(")


def op_names(hlo_text: str) -> dict[str, str]:
    """``{instruction name: op_name}`` for the instructions of a compiled HLO module's text; a
    fusion without its own ``op_name`` takes the first one inside its computation. Control flow
    (``while``, ``conditional``, ``call``) maps to ``""``: its events contain its body's."""
    names, inside, calls = {}, {}, {}
    computation = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and " = " not in line:
            computation = header.group(1)
            continue
        instruction = _INSTRUCTION.match(line)
        if not instruction:
            continue
        name = instruction.group(1)
        op_name = _OP_NAME.search(line)
        if _CONTROL_FLOW.search(line):
            names[name] = None
            continue
        names[name] = op_name.group(1) if op_name else ""
        if op_name and computation is not None:
            inside.setdefault(computation, op_name.group(1))
        called = _CALLS.search(line)
        if called:
            calls[name] = called.group(1)
    for name, called in calls.items():
        if not names[name]:
            names[name] = inside.get(called, "")
    return names


def profile(
    fn: Callable[[], object], hlo_text: str, trace_dir: Path, *, calls: int = 2, top: int = 12
) -> dict:
    """Traces ``calls`` calls of ``fn`` (already compiled and run once) and summarizes them
    (:func:`summarize`: the ``top`` instructions and checks by device time)."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    before = set(trace_dir.rglob("perfetto_trace.json.gz"))
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(calls):
            jax.block_until_ready(fn())
    (trace,) = set(trace_dir.rglob("perfetto_trace.json.gz")) - before
    return summarize(trace, op_names(hlo_text), calls=calls, top=top)


def summarize(trace: Path, names: dict[str, str], *, calls: int, top: int = 12) -> dict:
    """The device time, kernels and launch calls per call, and the ``top`` instructions by time.

    Raises:
      ValueError: the trace holds no event of an HLO instruction (it is not a trace of a
        compiled XLA program, or the profiler recorded nothing).
    """
    with gzip.open(trace, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    process = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    devices = {pid for pid, name in process.items() if name.startswith("/device:")}
    spans = [e for e in events if e.get("ph") == "X"]
    # Kernels on a device's streams; without a device (the CPU), XLA's thunks on the host.
    ops = [
        e
        for e in spans
        if "hlo_op" in e.get("args", {})
        and (not devices or e["pid"] in devices)
        and names.get(e["args"]["hlo_op"], "") is not None  # control flow: its body's events
    ]
    if not ops:
        raise ValueError(f"{trace}: no event of an HLO instruction; is it a trace of jitted code?")
    time_us, count = collections.Counter(), collections.Counter()
    for e in ops:
        time_us[e["args"]["hlo_op"]] += e.get("dur", 0.0)
        count[e["args"]["hlo_op"]] += 1
    launches = collections.Counter(
        e["name"] for e in spans if e["pid"] not in devices and "Launch" in e["name"]
    )
    # The host waiting on the device or copying from it (a cond's predicate read by the host).
    waits = collections.Counter(
        e["name"]
        for e in spans
        if e["pid"] not in devices and any(w in e["name"] for w in ("Synchronize", "Memcpy"))
    )
    checks_us, check_kernels = collections.Counter(), 0
    for op, us in time_us.items():
        group = check_group(names.get(op) or "")
        if group is not None:
            checks_us[group] += us
            check_kernels += count[op]
    return {
        "device_ms_per_call": sum(time_us.values()) / calls / 1e3,
        "check_ms_per_call": sum(checks_us.values()) / calls / 1e3,
        "check_kernels_per_call": check_kernels / calls,
        "top_checks": [
            {"check": group, "ms_per_call": us / calls / 1e3}
            for group, us in checks_us.most_common(top)
        ],
        "kernels_per_call": len(ops) / calls,
        "launch_calls_per_call": {k: v / calls for k, v in launches.most_common()},
        "host_waits_per_call": {k: v / calls for k, v in waits.most_common()},
        "top": [
            {
                "hlo_op": op,
                "op_name": names.get(op) or "",
                "ms_per_call": us / calls / 1e3,
                "runs_per_call": count[op] / calls,
            }
            for op, us in time_us.most_common(top)
        ],
    }


def check_group(op_name: str) -> str | None:
    """The check an instruction belongs to, from its ``op_name``: the site a GEMM's check names
    (:func:`sdcguard.protection.check_scope`), else the layer and direction; None for an
    instruction of the step itself.

    Example:
      >>> check_group("jit(s)/jvp(LM)/head/sdcguard_check[head:dot_general.grad_lhs]/abs")
      'head:dot_general.grad_lhs'
      >>> check_group("jit(step)/jvp(LM)/block_0/attn/sdcguard_check/reduce")
      'block_0/attn (forward)'
    """
    first = op_name.split(";")[0]
    at = first.find(CHECK_SCOPE)
    if at < 0:
        return None
    rest = first[at + len(CHECK_SCOPE) :]
    if rest.startswith("[") and "]" in rest:
        return rest[1 : rest.index("]")].replace("|", "/")
    # "jit(step)/transpose(jvp(LM))/block_0/mlp_in/" or, outside any scope, "jit(f)/jvp(".
    parts = first[:at].rstrip("/").split("/")[1:]
    backward = bool(parts) and parts[0].startswith("transpose(")
    layer = "/".join(parts[1:]) or "-"
    return f"{layer} ({'backward' if backward else 'forward'})"
