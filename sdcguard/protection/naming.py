"""Naming the GEMMs of a traced program: every ``dot_general`` gets a site name and a direction.

A site name says where a GEMM is in the user's model, so that ``include``/``exclude`` patterns,
fault plans, reports, campaigns and replay all speak of the same places. It is
``<module path>:<site>``, the module path written as the user's framework writes it:

* Flax linen: the module path under ``params`` (``decoder/block_0/mlp/fc_in:dot_general``);
* Flax NNX: the module's attribute path (``layers/0/attn/q_einsum:dot_general``);
* Equinox: the field path in the model pytree (``layers[0].mlp.layers[1]:dot_general``);
* anything else: ``jax.named_scope`` scopes, else the Python call path (``loss/mlp:dot_general``).

The rule, in order:

1. **A GEMM that reads a parameter is named after the module that owns it.** Each operand is
   followed back through the dataflow of the program (converts, reshapes, transposes,
   broadcasts, slices, concatenations, sharding annotations, and into and out of ``pjit``,
   ``closed_call``, ``remat``, ``custom_jvp``/``custom_vjp``, ``shard_map``, ``scan``, ``while``
   and ``cond`` bodies) to a traced argument; the argument's ``jax.tree_util`` key path, less
   the argument's position, a leading ``params`` collection or field, and the leaf's own name
   (``kernel``, ``weight``, NNX's ``.value``), is the module path. A layer stack scanned over
   stacked parameters is one site, named after the stacked module. The site is ``dot_general``,
   or the module's method when it is not ``__call__`` (``embed:attend``, ``embedder:decode``).
   When one module holds several weights that GEMMs read (a dict of ``wq``, ``wk``, ...), the
   leaf stays in the path (``attn/wq:dot_general``).
2. **A GEMM of two activations is named after the module whose GEMMs produced them**: the
   common parent of its operands' nearest producing GEMMs (``decoder/block_0/attn`` for QKᵀ,
   whose operands come from ``attn/query`` and ``attn/key``). The site is ``scores`` when both
   operands come from GEMMs, and ``context`` when one of them comes from a ``scores`` GEMM of
   the same module: the names the attention drop-ins use (:data:`~sdcguard.fault_model.sites.
   ATTENTION_SITES`). Operands produced more than one level apart (a token dispatch reading
   the residual stream) are not attention, and fall to rule 3.
3. **Otherwise** (no parameter, no producing GEMMs: plain ``jnp`` code over bare arrays): the
   ``jax.named_scope`` path if there is one (with linen's root-module class removed, so that it
   reads like rule 1), else the Python call path, as ``scope:function`` (``loss/mlp:dot_general``).

JAX's fused cuDNN attention (one equation, no GEMMs to see) is named as its GEMMs would be in
XLA: rule 2 over its query, keys and values (``decoder/block_0/attn``), else rule 3; its sites
(``:scores``, ``:context``, ...) are :mod:`sdcguard.protection.fused_attention`'s.

Where several forward GEMMs get one name (a module called twice, weights tied), the second is
``_1``, the third ``_2``, in program order. The backward GEMMs that ``jax.grad`` produced are
paired with the forward GEMM they differentiate and take its name with ``.grad_lhs`` /
``.grad_rhs``; a recomputation under ``remat`` takes the name of the forward GEMM it recomputes.

Why parameters, not scopes: NNX and Equinox leave no module scopes in the program (Equinox names a
scope by the class, ``eqx.nn.Linear``, a kind and not a place), and a Python call path repeats for
every layer called from the same line; a parameter's key path is what every framework already
shows its users (``nnx.state``, ``eqx.tree_at``, a linen ``params`` dict), it names each layer
and projection apart, and adding a layer renames no other. The same rule holds for linen, whose
scopes carry the root module's class (``GPT/decoder/...``) that no other tool shows; so one rule
gives one scheme. Attention's core GEMMs have no parameter; their operands' producers do.

Why one module: the walk over the program (:func:`collect_gemms`: each GEMM, where its operands
come from, which variables hold the same value) exists to name GEMMs, and the rules above and the
pairing of backward GEMMs read nothing else; split, each half would be read with the other.

Example:
  >>> closed = jax.make_jaxpr(train_step)(params, opt_state, batch)
  >>> name_gemms(closed.jaxpr, input_paths)   # {id(eqn): ("mlp/fc_in:dot_general", "forward")}
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import os
import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import jax.numpy as jnp
from jax._src import source_info_util
from jax.extend import core as jex_core

__all__ = [
    "Gemm",
    "ModulePath",
    "collect_attention_cores",
    "collect_gemms",
    "is_fused_attention",
    "module_of_path",
    "name_gemms",
    "name_program",
    "sub_jaxprs",
]

# The frames of sdcguard's own tracing code (transform.py) end where the user's function starts.
_TRANSFORM_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transform.py")
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
# More nearest producing GEMMs than this (the residual stream after many layers): too many to
# name anything after; the value counts as produced by "many".
_MAX_PRODUCERS = 32

# --- Module paths from the key paths of the traced arguments ------------------------------------

_KEY = re.compile(
    r"\.(?P<attr>[A-Za-z_]\w*)"
    r"|\[(?P<index>-?\d+)\]"
    r"|\[(?P<str>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\]"
    r"|\[(?P<other>[^\]]*)\]"
)


def _parse_keystr(path: str) -> list[tuple[str, str]]:
    """``"[0][0].layers[1]['w']"`` -> ``[('index','0'), ('index','0'), ('attr','layers'),
    ('index','1'), ('key','w')]`` (the inverse of ``jax.tree_util.keystr``)."""
    keys, pos = [], 0
    while pos < len(path):
        m = _KEY.match(path, pos)
        if m is None:  # not a key path jax wrote: keep the rest as one opaque key
            keys.append(("key", path[pos:]))
            break
        kind = m.lastgroup
        text = m.group(kind)
        if kind == "str":
            kind, text = "key", ast.literal_eval(text)
        elif kind == "other":
            kind = "key"
        keys.append((kind, text))
        pos = m.end()
    return keys


@dataclasses.dataclass(frozen=True)
class ModulePath:
    """A module's place in the model: keys from the model's root, and how to write them.

    Attributes:
      keys: ``(kind, name)`` pairs, kind ``'attr'`` (a field), ``'index'`` (a list position) or
        ``'key'`` (a dict key).
      slashed: ``True`` for ``layers/0/attn`` (linen, NNX, dicts); ``False`` for Python access
        notation, ``layers[0].attn`` (Equinox and other pytrees of objects).
    """

    keys: tuple[tuple[str, str], ...]
    slashed: bool

    def __str__(self) -> str:
        if self.slashed:
            return "/".join(name for _, name in self.keys)
        written = {"attr": ".{}", "index": "[{}]", "key": "[{!r}]"}
        return "".join(written[kind].format(name) for kind, name in self.keys).lstrip(".")

    @property
    def parent(self) -> ModulePath:
        return ModulePath(self.keys[:-1], self.slashed)


def module_of_path(path: str | None) -> tuple[ModulePath, ModulePath] | None:
    """The module that owns the traced argument at ``path`` (a ``keystr`` of ``(args, kwargs)``),
    and the same path with the leaf kept; ``None`` when the path names no module.

    Example:
      >>> str(module_of_path("[0][0]['params']['decoder']['block_0']['mlp']['fc_in']['kernel']")[0])
      'decoder/block_0/mlp/fc_in'
      >>> str(module_of_path("[0][0].layers[0].attn.q_einsum.kernel.value")[0])  # NNX
      'layers/0/attn/q_einsum'
      >>> str(module_of_path("[0][0].layers[0].mlp.layers[1].weight")[0])  # Equinox
      'layers[0].mlp.layers[1]'
    """
    if not path:
        return None
    keys = _parse_keystr(path)[2:]  # less (args, kwargs) and the argument's position or name
    nnx_variable = len(keys) >= 2 and keys[-1] == ("attr", "value")
    if nnx_variable:
        keys = keys[:-1]
    if keys and keys[0][1] == "params":  # a linen variables dict, or a train state's field
        keys = keys[1:]
    if len(keys) < 2:  # a bare array, or a leaf of the root: no module owns it
        return None
    slashed = nnx_variable or all(kind != "attr" for kind, _ in keys)
    return ModulePath(tuple(keys[:-1]), slashed), ModulePath(tuple(keys), slashed)


def _common(paths: Iterable[ModulePath]) -> ModulePath | None:
    paths = list(paths)
    if not paths:
        return None
    keys = paths[0].keys
    for p in paths[1:]:
        n = 0
        while n < min(len(keys), len(p.keys)) and keys[n] == p.keys[n]:
            n += 1
        keys = keys[:n]
    return ModulePath(keys, paths[0].slashed)


# --- The GEMMs of a program, and where their operands come from ---------------------------------


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
    """One dot_general equation seen while naming.

    Attributes:
      eqn: the equation.
      index: its position in program order.
      lhs_flow, rhs_flow: where its operands come from (:class:`Flow`).
      operands: the variables that first hold its two operands' values.
      scope: the ``jax.named_scope`` path it runs under, transformations removed.
      base: the name by scope or call path (rule 3 of the module docstring).
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
        self.index = index
        self.lhs_flow, self.rhs_flow = (*flows, _NOWHERE, _NOWHERE)[:2]
        # The operands as values, not variables: the same value whether cast, reshaped or
        # passed into a call under another variable (what pairs a backward GEMM with its
        # forward one).
        self.operands = tuple(operands) or tuple(eqn.invars[:2])
        self.scope, self.spec, self.backward = _clean_scope(name_stack)
        # The backward pass's recomputation of a GEMM under jax.checkpoint / remat.
        self.in_remat = "rematted_computation" in name_stack and not self.backward
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
        if _is_path(self.scope):
            self.base = f"{self.scope}:{inner or 'dot_general'}"
        else:
            self.base = f"{self.call_path or self.scope or 'fn'}:dot_general"
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
    if len(body.invars) == len(flows):  # pjit, remat, custom_jvp/vjp, shard_map, scan, ...
        return flows
    return [_NOWHERE] * len(body.invars)


def is_fused_attention(eqn) -> bool:
    """Whether ``eqn`` is one of JAX's fused (cuDNN) attention primitives, forward or backward
    (``dot_product_attention_fwd_wrapper``, ``..._bwd_wrapper``, their fp8 forms)."""
    return eqn.primitive.name.startswith("dot_product_attention")


def _walk(
    jaxpr,
    outer: str,
    flows: Sequence[Flow],
    found: list[Gemm],
    same: dict,
    cores: list[Gemm] | None = None,
) -> list[Flow]:
    """Appends every dot_general of ``jaxpr`` (and its sub-jaxprs) to ``found`` in program order,
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
        return v if isinstance(v, jex_core.Literal) else same.get(v, v)

    for eqn in jaxpr.eqns:
        stack = "/".join(p for p in (outer, str(eqn.source_info.name_stack)) if p)
        ins = [flow(v) for v in eqn.invars]
        outs: list[Flow] | None = None
        name = eqn.primitive.name
        if name == "dot_general":
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


def scan_consts_and_carry(params) -> tuple[int, int]:
    """How many of a ``scan`` equation's operands are constants and how many the carry (the
    rest are the scanned inputs): jax 0.10 names the counts; jax 0.11 packs the operands' tree
    in ``ft_in`` (constants, carry, inputs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))


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
    """Every dot_general of ``jaxpr`` and its sub-jaxprs, in program order; with ``cores``, the
    fused attention equations are appended to it (see :func:`_walk`)."""
    found: list[Gemm] = []
    flows = list(input_flows) + [_NOWHERE] * (len(jaxpr.invars) - len(input_flows))
    _walk(jaxpr, outer, flows, found, {}, cores)
    return found


def collect_attention_cores(jaxpr) -> list[Gemm]:
    """Every fused attention equation of ``jaxpr`` and its sub-jaxprs, in program order."""
    cores: list[Gemm] = []
    collect_gemms(jaxpr, cores=cores)
    return cores


# --- Naming ---------------------------------------------------------------------------------------


def _pair_backward(gemms: list[Gemm], forward_by_key: dict) -> dict[int, tuple[Gemm | None, str]]:
    """``backward GEMM index -> (the forward GEMM it differentiates, 'grad_lhs' | 'grad_rhs')``;
    ``None`` for the forward GEMM where the operands do not tell (the caller pairs by order).

    ``dA = g·Bᵀ`` reads B and ``dB = Aᵀ·g`` reads A, the very values of the forward GEMM when
    nothing was rematerialised. A weight B is read by one forward GEMM, so ``dA`` pairs first;
    an input A read by several (a gate and an up projection of the same ``x``) is told apart by
    the cotangent ``g``, which ``dB`` shares with its ``dA``. Otherwise the output shape tells
    which side it is, when lhs and rhs differ.
    """
    pairs: dict[int, tuple[Gemm | None, str]] = {}
    cotangent: dict[int, object] = {}  # forward GEMM index -> its output's cotangent
    for g in gemms:
        ops = set(g.operands)
        for fwd in forward_by_key.get(g.key, []):
            lhs, rhs = fwd.operands
            if rhs in ops and lhs not in ops:
                pairs[g.index] = (fwd, "grad_lhs")
                cotangent.setdefault(fwd.index, next(iter(ops - {rhs}), None))
                break
    for g in gemms:
        if g.index in pairs:
            continue
        ops = set(g.operands)
        forwards = forward_by_key.get(g.key, [])
        reading = [f for f in forwards if f.operands[0] in ops and f.operands[1] not in ops]
        if reading:
            fwd = next((f for f in reading if cotangent.get(f.index) in ops), reading[0])
            pairs[g.index] = (fwd, "grad_rhs")
            continue
        out, side = sorted(g.out_shape), ""
        for fwd in forwards:
            lhs, rhs = sorted(fwd.lhs_shape), sorted(fwd.rhs_shape)
            if out == lhs != rhs:
                side = "grad_lhs"
                break
            if out == rhs != lhs:
                side = "grad_rhs"
                break
        pairs[g.index] = (None, side)
    return pairs


class _Namer:
    """Base names (before counters) of the GEMMs of one program, by the module docstring's rules."""

    def __init__(self, gemms: list[Gemm], input_paths: Sequence[str | None]):
        self.gemms = gemms
        self.owners = [module_of_path(p) for p in input_paths]
        # The path a GEMM's operands' producers are measured from: its module for a GEMM of a
        # parameter (``attn/query``), its own path for a GEMM of activations (``attn``).
        self.place: dict[int, tuple[ModulePath, str]] = {}
        self.weight_of: dict[int, int] = {}  # GEMM index -> the argument it reads as weight
        for g in gemms:
            weights = [(0, i) for i in g.lhs_flow.params] + [(1, i) for i in g.rhs_flow.params]
            if weights:
                # The deeper-owned weight (a GEMM of two parameters: LoRA's A·B, a positional
                # table times a kernel); on a tie the right operand's, where x @ W keeps it.
                depth = {i: len(self.owners[i][0].keys) for _, i in weights}
                self.weight_of[g.index] = max(weights, key=lambda w: (depth[w[1]], w[0]))[1]
        self.roots = self._scope_roots()

    def _scope_roots(self) -> set[tuple[str, ...]]:
        """Scope prefixes that no module path has: the class of linen's root module (``GPT``),
        learned from the GEMMs whose scope ends with their parameter's module path."""
        roots = set()
        for g in self.gemms:
            if g.index in self.weight_of and _is_path(g.scope):
                module = self.owners[self.weight_of[g.index]][0]
                names, parts = [n for _, n in module.keys], g.scope.split("/")
                if module.slashed and len(parts) > len(names) and parts[-len(names) :] == names:
                    roots.add(tuple(parts[: -len(names)]))
        return roots

    def by_weight(self, g: Gemm, leaf_kept: bool = False) -> tuple[ModulePath, str]:
        module, with_leaf = self.owners[self.weight_of[g.index]]
        return (with_leaf if leaf_kept else module), g.method or "dot_general"

    def by_producers(self, g: Gemm) -> tuple[ModulePath, str] | None:
        if g.lhs_flow.producers is None or g.rhs_flow.producers is None:
            return None
        producers = g.lhs_flow.producers | g.rhs_flow.producers
        if not producers or any(p not in self.place for p in producers):
            return None
        parents = []
        for p in producers:
            path, site = self.place[p]
            parents.append(path if site in ("scores", "context") else path.parent)
        where = _common(parents)
        if not where.keys or any(len(p.keys) > len(where.keys) + 1 for p in parents):
            return None  # operands from far apart in the model: not one module's GEMM
        if any(self.place[p] == (where, "scores") for p in producers):
            return where, "context"
        if g.lhs_flow.producers and g.rhs_flow.producers:
            return where, "scores"
        return where, "dot_general"

    def by_scope(self, g: Gemm) -> str:
        if _is_path(g.scope):
            parts = g.scope.split("/")
            for root in sorted(self.roots, key=len, reverse=True):
                if tuple(parts[: len(root)]) == root and len(parts) > len(root):
                    return "/".join(parts[len(root) :]) + ":" + g.base.rsplit(":", 1)[1]
        return g.base

    def base_names(self, named: list[Gemm]) -> dict[int, str]:
        """``gemm index -> base name`` for ``named`` (in program order)."""
        weights_at: dict[tuple[ModulePath, str], set[int]] = collections.defaultdict(set)
        for g in named:
            if g.index in self.weight_of:
                weights_at[self.by_weight(g)].add(self.weight_of[g.index])
        out = {}
        for g in named:
            if g.index in self.weight_of:
                site = self.by_weight(g)
                if len(weights_at[site]) > 1:  # a module of several weights: the leaf says which
                    site = self.by_weight(g, leaf_kept=True)
            else:
                site = self.by_producers(g)
            if site is None:
                out[g.index] = self.by_scope(g)
                continue
            self.place[g.index] = site
            out[g.index] = f"{site[0]}:{site[1]}"
        return out


def name_gemms(jaxpr, input_paths: Sequence[str | None] = ()) -> dict[int, tuple[str, str]]:
    """``id(eqn) -> (site name, direction)`` for every dot_general of ``jaxpr``, nested ones too.

    The names of :func:`name_program` (see there).
    """
    return name_program(jaxpr, input_paths)[0]


def _name_cores(cores: list[Gemm], namer: _Namer) -> dict[int, str]:
    """``id(eqn) -> module path`` of each fused attention equation.

    The path is the one the attention core's GEMMs would get in XLA (rule 2: the common parent
    of the modules whose GEMMs produced the query, keys and values, ``layers/0/attn``), else
    the scope or call path (rule 3), so that choosing cuDNN attention renames no site. Forward
    cores sharing a path get ``_1``, ``_2`` in program order; a backward core (or a forward one
    recomputed under remat) takes the name of the forward core that read the same query, keys
    and values, else its path.
    """

    def path_of(c: Gemm) -> str:
        site = namer.by_producers(c)
        return str(site[0]) if site is not None else namer.by_scope(c).rsplit(":", 1)[0]

    out: dict[int, str] = {}
    by_operands: dict[tuple, str] = {}
    used: collections.Counter = collections.Counter()
    for c in cores:
        if "fwd" in c.eqn.primitive.name and not c.backward and not c.in_remat:
            path = path_of(c)
            name = path if used[path] == 0 else f"{path}_{used[path]}"
            used[path] += 1
            by_operands.setdefault(c.operands, name)
            out.setdefault(id(c.eqn), name)
    for c in cores:
        if id(c.eqn) not in out:
            out[id(c.eqn)] = by_operands.get(c.operands) or path_of(c)
    return out


def name_program(
    jaxpr, input_paths: Sequence[str | None] = ()
) -> tuple[dict[int, tuple[str, str]], dict[int, str]]:
    """``(gemm names, attention core paths)``: ``id(eqn) -> (site name, direction)`` for every
    dot_general of ``jaxpr``, nested ones too, and ``id(eqn) -> module path`` for every fused
    attention equation (:func:`is_fused_attention`, named by :func:`_name_cores`).

    Args:
      jaxpr: the traced program.
      input_paths: the ``jax.tree_util.keystr`` key path of each of ``jaxpr``'s inputs in
        ``(args, kwargs)`` (``"[0][0]['params']['mlp']['fc_in']['kernel']"``); ``None`` or
        missing for inputs that name nothing.

    Forward GEMMs are named by the rules of the module docstring, with ``_1``, ``_2``, ... in
    program order where several share a name (a module called twice). A recomputation under
    remat takes the name of the forward GEMM it recomputes (the backward pass recomputes in
    reverse order), so a fault at that site reaches both. A backward GEMM is named after the
    forward GEMM it differentiates, with ``.grad_lhs`` / ``.grad_rhs``.
    """
    paths = list(input_paths) + [None] * (len(jaxpr.invars) - len(input_paths))
    owned = [module_of_path(p) is not None for p in paths]
    flows = [
        Flow(frozenset({i}) if owned[i] else frozenset(), frozenset()) for i in range(len(paths))
    ]
    cores: list[Gemm] = []
    gemms = collect_gemms(jaxpr, input_flows=flows, cores=cores)
    namer = _Namer(gemms, paths)
    is_forward = [not g.backward and not g.in_remat for g in gemms]
    # Forward GEMMs first, then GEMMs of backward rules or of remat alone (no forward GEMM at
    # their call place): sites of their own.
    forward_by_key: dict[tuple, list[Gemm]] = collections.defaultdict(list)
    for g, fwd in zip(gemms, is_forward, strict=True):
        if fwd:
            forward_by_key[g.key].append(g)
    own = [
        g for g, fwd in zip(gemms, is_forward, strict=True) if fwd or g.key not in forward_by_key
    ]
    bases = namer.base_names(own)
    name_of: dict[int, str] = {}
    used: collections.Counter = collections.Counter()
    for g in own:
        n = used[bases[g.index]]
        used[bases[g.index]] += 1
        name_of[g.index] = bases[g.index] if n == 0 else f"{bases[g.index]}_{n}"
    pairs = _pair_backward(
        [g for g in gemms if g.backward and g.key in forward_by_key], forward_by_key
    )
    names: dict[int, tuple[str, str]] = {}
    recomputed: collections.Counter = collections.Counter()
    backward_seen: collections.Counter = collections.Counter()
    for g, fwd_here in zip(gemms, is_forward, strict=True):
        forwards = forward_by_key.get(g.key, [])
        if fwd_here or not forwards:
            name = (name_of[g.index], "forward")
        elif not g.backward:
            k = recomputed[g.key]
            recomputed[g.key] += 1
            name = (name_of[forwards[-1 - k % len(forwards)].index], "forward")
        else:
            fwd, side = pairs[g.index]
            k = backward_seen[g.key]
            backward_seen[g.key] += 1
            if fwd is None:  # two gradient GEMMs per forward one, last layer first
                fwd = forwards[-1 - (k // 2) % len(forwards)]
            if not side:  # square operands, rematerialised: JAX transposes the rhs first
                side = ("grad_rhs", "grad_lhs")[k % 2]
            name = (f"{name_of[fwd.index]}.{side}", side)
        names.setdefault(id(g.eqn), name)  # one jaxpr called twice: its first call's name
    return names, _name_cores(cores, namer)
