"""The walk over a traced program: every GEMM, and where its operands come from.

:func:`collect_gemms` visits every GEMM (a ``dot_general``, a grouped GEMM or a convolution:
:data:`GEMM_PRIMITIVES`) of a jaxpr and of the jaxprs nested in it
(``jit``, ``scan``, ``while``, ``cond``, ``remat``, ``custom_jvp``/``custom_vjp``,
``shard_map``, ...), in program order, and follows each operand back through the dataflow
(:class:`Flow`): to the traced arguments it is a moved, cast or sliced copy of, and to the GEMMs
nearest upstream of it. Naming (:mod:`sdcguard.protection._naming`) and site selection
(:mod:`sdcguard.protection._select`) read it. See docs/protection.md, "Site names".
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp
from jax._src import source_info_util
from jax.extend import core as jex_core

from sdcguard._jax_compat import scan_consts_and_carry

# The frames of sdcguard's own tracing code end where the user's function starts.
_TRACE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_trace.py")
_WRAPPED = re.compile(r"^[A-Za-z_][\w.]*\((.*)\)$")
# Name-stack components that say how a value was computed, not where in the model it is.
_NOT_A_PLACE = {"rematted_computation", "checkpoint", "remat", "<lambda>"}

# Primitives whose output is their operand's values moved, cast or sliced: a weight stays the
# weight through them (``kernel.astype(bf16).T``, a scanned layer's slice, an all-gathered shard).
_PASS_THROUGH = {
    "convert_element_type",
    "reshape",
    "transpose",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "slice",
    "dynamic_slice",
    "rev",
    "copy",
    "copy_p",
    "reduce_precision",
    "concatenate",
    "device_put",
    "sharding_constraint",
    "mesh_cast",
    "reshard",
    "pvary",
    "pcast",
    "all_gather",
    "all_gather_invariant",
    "optimization_barrier",
}
# The primitives that are GEMMs to the walk, named and checked: ``dot_general``, the grouped
# GEMM of mixture-of-experts layers (``jax.lax.ragged_dot``) and convolutions, the last two
# checked by their own primitive (:mod:`sdcguard.protection._primitive_checks`).
GEMM_PRIMITIVES = ("dot_general", "ragged_dot_general", "conv_general_dilated")
# More nearest producing GEMMs than this (the residual stream after many layers): too many to
# name anything after; the value counts as produced by "many".
_MAX_PRODUCERS = 32


class Flow(NamedTuple):
    """Where a value of the program comes from.

    Attributes:
      params: the indices of the traced arguments it is (moved, cast or sliced), of those
        arguments that a module owns.
      producers: the GEMMs (indices in program order) nearest upstream of it; ``None`` for
        more than ``_MAX_PRODUCERS``.
    """

    params: frozenset
    producers: frozenset | None


_NOWHERE = Flow(frozenset(), frozenset())


def _union(flows: Sequence[Flow], keep_params: bool = True) -> Flow:
    params = frozenset().union(*(f.params for f in flows)) if keep_params else frozenset()
    if any(f.producers is None for f in flows):
        return Flow(params, None)
    producers = frozenset().union(*(f.producers for f in flows))
    return Flow(params, producers if len(producers) <= _MAX_PRODUCERS else None)


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


def is_path(scope: str) -> bool:
    # Equinox names each module call by its class (``eqx.nn.Linear``): a kind, not a place.
    return bool(scope) and ("/" in scope or "." not in scope)


def _user_frames(eqn) -> list:
    """The Python frames of the code ``fn`` ran, outermost first, below ``fn`` itself."""
    tb = eqn.source_info.traceback
    frames = list(source_info_util.user_frames(tb))[::-1] if tb is not None else []
    ours = [i for i, f in enumerate(frames) if os.path.abspath(f.file_name) == _TRACE_FILE]
    if ours:
        frames = frames[ours[-1] + 2 :]  # drop the tracing frames and fn's own frame
    return frames


class Gemm:
    """One GEMM equation seen while naming (a primitive of :data:`GEMM_PRIMITIVES`).

    Attributes:
      eqn: the equation.
      kind: its primitive's name (``'dot_general'``, ``'conv_general_dilated'``, ...): what a site
        name ends with when no module method names it.
      index: its position in program order.
      lhs_flow, rhs_flow: where its operands come from (:class:`Flow`).
      operands: the variables that first hold its two operands' values.
      scope: the ``jax.named_scope`` path it runs under, transformations removed.
      base: the name by scope or call path (the last rule of docs/protection.md, "Site names").
      method: the module method that ran it when that is not ``__call__`` (``attend``), or ``''``.
    """

    def __init__(
        self,
        eqn,
        name_stack: str,
        index: int = 0,
        flows: Sequence[Flow] = (),
        operands: Sequence = (),
    ):
        self.eqn = eqn
        self.kind = eqn.primitive.name
        self.index = index
        self.lhs_flow, self.rhs_flow = (*flows, _NOWHERE, _NOWHERE)[:2]
        # The operands as values, not variables: the same value whether cast, reshaped or
        # passed into a call under another variable (what pairs a backward GEMM with its
        # forward one).
        self.operands = tuple(operands) or tuple(eqn.invars[:2])
        self.scope, self.spec, self.backward = _clean_scope(name_stack)
        # The backward pass's recomputation of a forward GEMM under jax.checkpoint / remat: in
        # the backward pass (``transpose(...)/rematted_computation``), but no gradient.
        self.in_remat = "rematted_computation" in name_stack
        self.backward = self.backward and not self.in_remat
        frames = _user_frames(eqn)
        self.key = (self.scope, tuple((f.file_name, f.start_line) for f in frames))
        # A function's own name, without the functions it is nested in (``f.<locals>.g``: g).
        names = [f.function_name.rsplit("<locals>.", 1)[-1] for f in frames]
        innermost = names[-1] if names else ""
        inner = innermost.rsplit(".", 1)[-1]
        inner = "" if inner in ("__call__", "<lambda>") else inner
        self.method = inner if "." in innermost else ""  # Embed.attend: attend
        if len(frames) == 1:
            # Bodies of scan, while and checkpoint keep only their innermost frame: its lexical
            # nesting (``loss.<locals>.layer``: ``loss/layer``) is what is left of the path.
            names = frames[0].function_name.split(".<locals>.")
        self.call_path = "/".join(names)
        if is_path(self.scope):
            self.base = f"{self.scope}:{inner or self.kind}"
        else:
            self.base = f"{self.call_path or self.scope or 'fn'}:{self.kind}"
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


def _body_inputs(eqn, body, flows: list[Flow]) -> list[Flow]:
    """The flows into ``body``'s inputs, from the flows into ``eqn``'s operands."""
    p = eqn.params
    if eqn.primitive.name == "while":
        n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
        carry = flows[n_cond + n_body :]
        if body is p["cond_jaxpr"].jaxpr:
            return flows[:n_cond] + carry
        return flows[n_cond : n_cond + n_body] + carry
    if eqn.primitive.name == "cond":
        return flows[1:]  # the branch index is the first operand
    if len(body.invars) == len(flows):  # jit, remat, custom_jvp/vjp, shard_map, scan, ...
        return flows
    return [_NOWHERE] * len(body.invars)


def is_fused_attention(eqn) -> bool:
    """Whether ``eqn`` is one of JAX's fused (cuDNN) attention primitives, forward or backward
    (``dot_product_attention_fwd_wrapper``, ``..._bwd_wrapper``, their fp8 forms)."""
    return eqn.primitive.name.startswith("dot_product_attention")


class _LiteralOperand:
    """A GEMM operand that is a jaxpr literal, compared by identity (see :class:`Gemm`)."""

    __slots__ = ("literal",)

    def __init__(self, literal):
        self.literal = literal


def _walk(
    jaxpr,
    outer: str,
    flows: Sequence[Flow],
    found: list[Gemm],
    same: dict,
    cores: list[Gemm] | None = None,
) -> list[Flow]:
    """Appends every GEMM of ``jaxpr`` (and its sub-jaxprs) to ``found`` in program order,
    with where its operands come from; returns where ``jaxpr``'s outputs come from. With
    ``cores``, appends there every fused attention equation (:func:`is_fused_attention`), its
    flows those of the query and of the keys and values, its operands the three of them.

    ``outer`` is the name stack of the equations that hold ``jaxpr``: the body of a scan keeps
    only its own names, and that it runs in the backward pass (``transpose(...)``) is said by
    the scan equation around it. ``same`` maps a variable to the variable that first held its
    value (through casts, reshapes and call boundaries); it is filled in as the walk goes.
    """
    env: dict = dict(zip(jaxpr.invars, flows, strict=False))

    def flow(v) -> Flow:
        return _NOWHERE if isinstance(v, jex_core.Literal) else env.get(v, _NOWHERE)

    def first(v):
        # A literal operand (the constant cotangent 1.0 of a scalar output) follows no variable
        # and is not hashable: it stands for itself.
        return _LiteralOperand(v) if isinstance(v, jex_core.Literal) else same.get(v, v)

    for eqn in jaxpr.eqns:
        stack = "/".join(p for p in (outer, str(eqn.source_info.name_stack)) if p)
        ins = [flow(v) for v in eqn.invars]
        outs: list[Flow] | None = None
        name = eqn.primitive.name
        if name in GEMM_PRIMITIVES:
            operands = [first(v) for v in eqn.invars[:2]]
            found.append(Gemm(eqn, stack, len(found), ins, operands))
            outs = [Flow(frozenset(), frozenset({len(found) - 1}))]
        elif cores is not None and is_fused_attention(eqn) and len(eqn.invars) >= 3:
            operands = [first(v) for v in eqn.invars[:3]]
            cores.append(Gemm(eqn, stack, len(cores), [ins[0], _union(ins[1:3])], operands))
        elif (
            name in _PASS_THROUGH
            and len(eqn.invars) == len(eqn.outvars) == 1
            and not isinstance(eqn.invars[0], jex_core.Literal)
        ):
            same[eqn.outvars[0]] = first(eqn.invars[0])
        for body in sub_jaxprs(eqn):
            if len(body.invars) == len(eqn.invars):
                for i, (inner, v) in enumerate(zip(body.invars, eqn.invars, strict=True)):
                    if not isinstance(v, jex_core.Literal) and not _is_carry(eqn, i):
                        same[inner] = first(v)
            body_outs = _walk(body, stack, _body_inputs(eqn, body, ins), found, same, cores)
            if len(body_outs) == len(eqn.outvars):  # not a while's condition
                outs = (
                    body_outs
                    if outs is None
                    else [_union(p) for p in zip(outs, body_outs, strict=True)]
                )
        if outs is None:
            n = len(eqn.outvars)
            if eqn.primitive.name in _PASS_THROUGH:
                outs = ins if len(ins) == n else [_union(ins)] * n
            else:
                outs = [_union(ins, keep_params=_keeps_params(eqn, ins))] * n
        for v, f in zip(eqn.outvars, outs, strict=True):
            env[v] = f
    return [flow(v) for v in jaxpr.outvars]


def _is_carry(eqn, i: int) -> bool:
    """Whether operand ``i`` of a scan is a loop carry (its body's input changes per step)."""
    if eqn.primitive.name != "scan":
        return False
    n_consts, n_carry = scan_consts_and_carry(eqn.params)
    return n_consts <= i < n_consts + n_carry


def _keeps_params(eqn, ins: list[Flow]) -> bool:
    """Whether an elementwise step leaves a weight a weight: only scaled by constants
    (``kernel * 0.5``, ``1 + scale``), not combined with data (``x * scale``)."""
    if not any(f.params for f in ins):
        return False
    return all(
        f.params or (not f.producers and f.producers is not None and v.aval.shape == ())
        for v, f in zip(eqn.invars, ins, strict=True)
    )


def collect_gemms(
    jaxpr, outer: str = "", input_flows: Sequence[Flow] = (), cores: list[Gemm] | None = None
) -> list[Gemm]:
    """Every GEMM of ``jaxpr`` and its sub-jaxprs (:data:`GEMM_PRIMITIVES`), in program order;
    with ``cores``, the fused attention equations are appended to it (see :func:`_walk`)."""
    found: list[Gemm] = []
    flows = list(input_flows) + [_NOWHERE] * (len(jaxpr.invars) - len(input_flows))
    _walk(jaxpr, outer, flows, found, {}, cores)
    return found


def collect_attention_cores(jaxpr) -> list[Gemm]:
    """Every fused attention equation of ``jaxpr`` and its sub-jaxprs, in program order."""
    cores: list[Gemm] = []
    collect_gemms(jaxpr, cores=cores)
    return cores
