"""Naming the GEMMs of a traced program: every ``dot_general`` gets a site name and a direction.

A site name says where a GEMM is in the user's model, so that ``include``/``exclude`` patterns,
fault plans, reports, campaigns and replay all speak of the same places. The backward GEMMs
that ``jax.grad`` produced are paired with the forward GEMM they differentiate and take its name
with ``.grad_lhs`` / ``.grad_rhs``.

Example:
  >>> closed = jax.make_jaxpr(train_step)(state, batch)
  >>> name_gemms(closed.jaxpr, input_paths)   # {id(eqn): ("mlp/Dense_0:dot_general", "forward")}
"""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Sequence

import jax.numpy as jnp
from jax._src import source_info_util
from jax.extend import core as jex_core

__all__ = ["Gemm", "collect_gemms", "name_gemms", "sub_jaxprs"]

# The frames of sdcguard's own tracing code (transform.py) end where the user's function starts.
_TRANSFORM_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transform.py")
_WRAPPED = re.compile(r"^[A-Za-z_][\w.]*\((.*)\)$")
# Name-stack components that say how a value was computed, not where in the model it is.
_NOT_A_PLACE = {"rematted_computation", "checkpoint", "remat", "<lambda>"}

# --- Naming the GEMMs of a program --------------------------------------------------------------


def _clean_scope(name_stack: str) -> tuple[str, str | None, bool]:
    """``(scope, einsum_spec, is_backward)`` from a name stack like
    ``transpose(jvp(GPT))/decoder/block_0/attn/...qhd,...khd->...hqk``."""
    backward = "transpose(" in name_stack
    parts, spec = [], None
    for part in name_stack.split("/") if name_stack else []:
        while (m := _WRAPPED.match(part)) is not None:
            part = m.group(1)
        if "->" in part:
            spec = part
        elif part and part not in _NOT_A_PLACE:
            parts.append(part)
    return "/".join(parts), spec, backward


def _is_path(scope: str) -> bool:
    # Equinox names each module call by its class (``eqx.nn.Linear``): a kind, not a place.
    return bool(scope) and ("/" in scope or "." not in scope)


def _user_frames(eqn) -> list:
    """The Python frames of the code ``fn`` ran, outermost first, below ``fn`` itself."""
    tb = eqn.source_info.traceback
    frames = list(source_info_util.user_frames(tb))[::-1] if tb is not None else []
    ours = [i for i, f in enumerate(frames) if os.path.abspath(f.file_name) == _TRANSFORM_FILE]
    if ours:
        frames = frames[ours[-1] + 2 :]  # drop the tracing frames and fn's own frame
    return frames


class Gemm:
    """One dot_general equation seen while naming."""

    def __init__(self, eqn, name_stack: str):
        self.eqn = eqn
        scope, self.spec, self.backward = _clean_scope(name_stack)
        # The backward pass's recomputation of a GEMM under jax.checkpoint / remat.
        self.in_remat = "rematted_computation" in name_stack and not self.backward
        frames = _user_frames(eqn)
        self.key = (scope, tuple((f.file_name, f.start_line) for f in frames))
        # A function's own name, without the functions it is nested in (``f.<locals>.g``: g).
        names = [f.function_name.rsplit("<locals>.", 1)[-1] for f in frames]
        if len(frames) == 1:
            # Bodies of scan, while and checkpoint keep only their innermost frame: its lexical
            # nesting (``loss.<locals>.layer``: ``loss/layer``) is what is left of the path.
            names = frames[0].function_name.split(".<locals>.")
        if _is_path(scope):
            where = scope
            inner = names[-1].rsplit(".", 1)[-1] if names else ""
            what = inner if inner and inner not in ("__call__", "<lambda>") else "dot_general"
        else:
            where = "/".join(names) or scope or "fn"
            what = "dot_general"
        self.base = f"{where}:{what}"
        lhs, rhs = eqn.invars[:2]
        self.lhs_shape, self.rhs_shape = tuple(lhs.aval.shape), tuple(rhs.aval.shape)
        self.out_shape = tuple(eqn.outvars[0].aval.shape)
        self.dtype = jnp.dtype(lhs.aval.dtype)


def sub_jaxprs(eqn):
    for value in eqn.params.values():
        items = value if isinstance(value, tuple | list) else (value,)
        for item in items:
            if isinstance(item, jex_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex_core.Jaxpr):
                yield item


def collect_gemms(jaxpr, outer: str = "") -> list[Gemm]:
    """Every dot_general of ``jaxpr`` and its sub-jaxprs, in program order.

    ``outer`` is the name stack of the equations that hold ``jaxpr``: the body of a scan keeps
    only its own names, and that it runs in the backward pass (``transpose(...)``) is said by
    the scan equation around it.
    """
    found = []
    for eqn in jaxpr.eqns:
        stack = "/".join(p for p in (outer, str(eqn.source_info.name_stack)) if p)
        if eqn.primitive.name == "dot_general":
            found.append(Gemm(eqn, stack))
        for sub in sub_jaxprs(eqn):
            found += collect_gemms(sub, stack)
    return found


def _grad_side(gemm: Gemm, forwards: list[Gemm]) -> tuple[Gemm | None, str]:
    """The forward GEMM a backward GEMM differentiates, and which operand's gradient it is.

    ``dA = g·Bᵀ`` reads B and ``dB = Aᵀ·g`` reads A: the very variables of the forward GEMM
    when nothing was rematerialised. Otherwise the output shape tells, when lhs and rhs differ.
    """
    operands = set(map(id, gemm.eqn.invars[:2]))
    for fwd in forwards:
        lhs, rhs = map(id, fwd.eqn.invars[:2])
        if rhs in operands and lhs not in operands:
            return fwd, "grad_lhs"
        if lhs in operands and rhs not in operands:
            return fwd, "grad_rhs"
    out = sorted(gemm.out_shape)
    for fwd in forwards:
        lhs, rhs = sorted(fwd.lhs_shape), sorted(fwd.rhs_shape)
        if out == lhs != rhs:
            return None, "grad_lhs"
        if out == rhs != lhs:
            return None, "grad_rhs"
    return None, ""


def name_gemms(jaxpr, input_paths: Sequence[str | None] = ()) -> dict[int, tuple[str, str]]:
    """``id(eqn) -> (site name, direction)`` for every dot_general of ``jaxpr``, nested ones too.

    Forward GEMMs are named by place and call site, with ``_1``, ``_2``, ... in program order
    where several share a base name (a layer object called in a Python loop). A recomputation
    under remat takes the name of the forward GEMM it recomputes (the backward pass recomputes
    in reverse order), so a fault at that site reaches both. A backward GEMM is named after the
    forward GEMM it differentiates, with ``.grad_lhs`` / ``.grad_rhs``.
    """
    gemms = collect_gemms(jaxpr)
    forward_by_key: dict[tuple, list[Gemm]] = collections.defaultdict(list)
    name_of: dict[int, str] = {}
    used: collections.Counter = collections.Counter()
    for g in gemms:
        if g.backward or g.in_remat:
            continue
        forward_by_key[g.key].append(g)
        n = used[g.base]
        used[g.base] += 1
        name_of[id(g)] = g.base if n == 0 else f"{g.base}_{n}"
    names: dict[int, tuple[str, str]] = {}
    recomputed: collections.Counter = collections.Counter()
    backward_seen: collections.Counter = collections.Counter()
    for g in gemms:
        forwards = forward_by_key.get(g.key, [])
        if not g.backward and not g.in_remat:
            names[id(g.eqn)] = (name_of[id(g)], "forward")
        elif not forwards:  # a GEMM of a backward rule or of remat alone: a site of its own
            n = used[g.base]
            used[g.base] += 1
            names[id(g.eqn)] = (g.base if n == 0 else f"{g.base}_{n}", "forward")
        elif not g.backward:
            k = recomputed[g.key]
            recomputed[g.key] += 1
            names[id(g.eqn)] = (name_of[id(forwards[-1 - k % len(forwards)])], "forward")
        else:
            fwd, side = _grad_side(g, forwards)
            k = backward_seen[g.key]
            backward_seen[g.key] += 1
            if fwd is None:  # two gradient GEMMs per forward one, last layer first
                fwd = forwards[-1 - (k // 2) % len(forwards)]
            if not side:  # square operands, rematerialised: JAX transposes the rhs first
                side = ("grad_rhs", "grad_lhs")[k % 2]
            names[id(g.eqn)] = (f"{name_of[id(fwd)]}.{side}", side)
    return names
