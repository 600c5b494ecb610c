"""Site names for the GEMMs of a traced program: ``<module path>:<site>`` and a direction.

The module path is written as the user's framework writes it (linen ``decoder/block_0/mlp/fc_in``,
NNX ``layers/0/attn/q_einsum``, Equinox ``layers[0].mlp.layers[1]``). A GEMM that reads a
parameter is named after the parameter's module; a GEMM of two activations after the module
whose GEMMs produced them (``attn:scores``, ``attn:context``); anything else by its
``jax.named_scope`` or Python call path. Backward GEMMs take their forward GEMM's name with
``.grad_lhs`` / ``.grad_rhs``. The rules and their reasons: docs/protection.md, "Site names".

Example:
  >>> closed = jax.make_jaxpr(train_step)(params, opt_state, batch)
  >>> name_gemms(closed.jaxpr, input_paths)   # {id(eqn): ("mlp/fc_in:dot_general", "forward")}
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import re
from collections.abc import Iterable, Sequence

from sdcguard.protection._walk import Flow, Gemm, collect_gemms, is_path

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


# --- Naming ---------------------------------------------------------------------------------------


def _pair_backward(gemms: list[Gemm], forward_by_key: dict) -> dict[int, tuple[Gemm | None, str]]:
    """``backward GEMM index -> (the forward GEMM it differentiates, 'grad_lhs' | 'grad_rhs')``;
    ``None`` for the forward GEMM where the operands do not tell (the caller pairs by order).

    ``dA = g·Bᵀ`` reads B and ``dB = Aᵀ·g`` reads A, the very values of the forward GEMM when
    nothing was rematerialised; both read the output's cotangent ``g``. A gradient that only
    one forward GEMM can have is paired first; where several could (an input A read by a gate
    and an up projection, a weight B applied twice in a loop), the one whose other gradient
    read the same cotangent is taken. Otherwise the output shape tells which side it is, when
    lhs and rhs differ.
    """
    pairs: dict[int, tuple[Gemm | None, str]] = {}
    cotangent: dict[tuple[int, str], object] = {}  # (forward index, side) -> its cotangent

    def candidates(g: Gemm, side: str) -> list[Gemm]:
        ops = set(g.operands)
        read, other = (1, 0) if side == "grad_lhs" else (0, 1)
        forwards = forward_by_key.get(g.key, [])
        return [f for f in forwards if f.operands[read] in ops and f.operands[other] not in ops]

    def pair(g: Gemm, fwd: Gemm, side: str) -> None:
        pairs[g.index] = (fwd, side)
        read = fwd.operands[1 if side == "grad_lhs" else 0]
        cotangent.setdefault((fwd.index, side), next(iter(set(g.operands) - {read}), None))

    # A gradient GEMM reads one operand of its forward GEMM and not the other: dA first, as a
    # weight is read by one forward GEMM, unless a loop applies it again.
    for side in ("grad_lhs", "grad_rhs"):
        for g in gemms:
            found = candidates(g, side) if g.index not in pairs else []
            if len(found) == 1:
                pair(g, found[0], side)
    for side, other in (("grad_lhs", "grad_rhs"), ("grad_rhs", "grad_lhs")):
        for g in gemms:
            found = candidates(g, side) if g.index not in pairs else []
            if found:
                ops = set(g.operands)
                by_cotangent = [f for f in found if cotangent.get((f.index, other)) in ops]
                pair(g, (by_cotangent or found)[0], side)
    for g in gemms:
        if g.index in pairs:
            continue
        out, side = sorted(g.out_shape), ""
        for fwd in forward_by_key.get(g.key, []):
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
    """Base names (before counters) of the GEMMs of one program (docs/protection.md, "Site
    names")."""

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
            if g.index in self.weight_of and is_path(g.scope):
                module = self.owners[self.weight_of[g.index]][0]
                names, parts = [n for _, n in module.keys], g.scope.split("/")
                if module.slashed and len(parts) > len(names) and parts[-len(names) :] == names:
                    roots.add(tuple(parts[: -len(names)]))
        return roots

    def by_weight(self, g: Gemm, leaf_kept: bool = False) -> tuple[ModulePath, str]:
        module, with_leaf = self.owners[self.weight_of[g.index]]
        return (with_leaf if leaf_kept else module), g.method or g.kind

    def by_producers(
        self, g: Gemm, ignore: frozenset = frozenset()
    ) -> tuple[ModulePath, str] | None:
        """Named by where its operands were computed; ``ignore``: producers not to count when
        others remain (the cotangents a backward rule reads come from the layers above)."""
        if g.lhs_flow.producers is None or g.rhs_flow.producers is None:
            return None
        producers = g.lhs_flow.producers | g.rhs_flow.producers
        producers = (producers - ignore) or producers
        if not producers or any(p not in self.place for p in producers):
            return None
        parents = []
        for p in producers:
            path, site = self.place[p]
            parents.append(path if site in ("scores", "context", "backward") else path.parent)
        where = _common(parents)
        if not where.keys or any(len(p.keys) > len(where.keys) + 1 for p in parents):
            return None  # operands from far apart in the model: not one module's GEMM
        if g.kind != "dot_general":
            return where, g.kind  # a grouped GEMM is no attention core
        if any(self.place[p] == (where, "scores") for p in producers):
            return where, "context"
        if g.lhs_flow.producers and g.rhs_flow.producers:
            return where, "scores"
        return where, g.kind

    def by_scope(self, g: Gemm) -> str:
        if is_path(g.scope):
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
    """``id(eqn) -> (site name, direction)`` for every dot_general of ``jaxpr``
    (:func:`name_program`'s first result)."""
    return name_program(jaxpr, input_paths)[0]


def _name_cores(cores: list[Gemm], namer: _Namer) -> dict[int, str]:
    """``id(eqn) -> module path`` of each fused attention equation: the path its GEMMs would
    get in XLA, so that choosing cuDNN attention renames no site; a backward (or rematted) core
    takes the path of the forward core that read the same query, keys and values."""

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


def _numbered(gemms: list[Gemm], bases: dict[int, str]) -> dict[int, str]:
    """``gemm index -> name``: ``bases``, with ``_1``, ``_2`` for repeats in program order."""
    out: dict[int, str] = {}
    used: collections.Counter = collections.Counter()
    for g in gemms:
        n = used[bases[g.index]]
        used[bases[g.index]] += 1
        out[g.index] = bases[g.index] if n == 0 else f"{bases[g.index]}_{n}"
    return out


def _name_rule_gemms(
    rule: list[Gemm],
    gemms: list[Gemm],
    is_forward: list[bool],
    name_of: dict[int, str],
    namer: _Namer,
) -> dict[Gemm, tuple[str, str]]:
    """Names and directions of the GEMMs a ``custom_vjp`` / ``custom_jvp`` rule runs in the
    backward pass (docs/protection.md, "Site names").

    One that reads an operand of a forward GEMM and not the other is that GEMM's gradient
    (``attn:context.grad_rhs`` reads the probabilities, as JAX's own would); any other is
    ``<module>:backward`` (``_1``, ``_2``, ...), the module being where the values it reads were
    computed, direction ``'backward'``.
    """
    forwards = [g for g, fwd in zip(gemms, is_forward, strict=True) if fwd]
    pairs = _pair_backward(rule, {g.key: forwards for g in rule})
    in_rule = {g.index for g in rule}
    cotangents = frozenset(g.index for g in gemms if g.backward and g.index not in in_rule)
    out: dict[Gemm, tuple[str, str]] = {}
    bases: dict[int, str] = {}
    unpaired = []
    for g in rule:
        fwd, side = pairs[g.index]
        # A gradient has its operand's shape: a GEMM that reads one operand of a forward GEMM
        # and has another shape recomputes something (a flash kernel's scores), no gradient.
        operand = {"grad_lhs": fwd.lhs_shape, "grad_rhs": fwd.rhs_shape}.get(side) if fwd else None
        if operand is not None and sorted(operand) == sorted(g.out_shape):
            out[g] = (f"{name_of[fwd.index]}.{side}", side)
            if fwd.index in namer.place:
                namer.place[g.index] = namer.place[fwd.index]
            continue
        site = namer.by_producers(g, cotangents)
        if site is None and g.index in namer.weight_of:
            site = namer.by_weight(g)
        where = str(site[0]) if site is not None else namer.by_scope(g).rsplit(":", 1)[0]
        if site is not None:
            namer.place[g.index] = (site[0], "backward")
        bases[g.index] = f"{where}:backward"
        unpaired.append(g)
    for g in unpaired:
        out[g] = (_numbered(unpaired, bases)[g.index], "backward")
    return out


def name_program(
    jaxpr, input_paths: Sequence[str | None] = ()
) -> tuple[dict[int, tuple[str, str]], dict[int, str]]:
    """The site names of every GEMM and the paths of every fused attention equation.

    Several forward GEMMs of one name get ``_1``, ``_2`` in program order; a recomputation
    under remat takes the name of the forward GEMM it recomputes; a backward GEMM takes its
    forward GEMM's name with ``.grad_lhs`` / ``.grad_rhs``.

    Args:
      jaxpr: the traced program.
      input_paths: the ``jax.tree_util.keystr`` key path of each input in ``(args, kwargs)``
        (``"[0][0]['params']['mlp']['fc_in']['kernel']"``); ``None`` or missing: names nothing.

    Returns:
      ``(names, core_paths)``: ``id(eqn) -> (site name, direction)`` for every dot_general,
      nested ones too, and ``id(eqn) -> module path`` for every fused attention equation.
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
    # Forward GEMMs first, then GEMMs of remat alone (no forward GEMM at their call place):
    # sites of their own. Backward GEMMs with no forward GEMM at their call place run in a
    # custom_vjp / custom_jvp rule: see _name_rule_gemms.
    forward_by_key: dict[tuple, list[Gemm]] = collections.defaultdict(list)
    for g, fwd in zip(gemms, is_forward, strict=True):
        if fwd:
            forward_by_key[g.key].append(g)
    rule = [g for g in gemms if g.backward and g.key not in forward_by_key]
    in_rule = {g.index for g in rule}
    own = [
        g
        for g, fwd in zip(gemms, is_forward, strict=True)
        if (fwd or g.key not in forward_by_key) and g.index not in in_rule
    ]
    name_of = _numbered(own, namer.base_names(own))
    pairs = _pair_backward(
        [g for g in gemms if g.backward and g.key in forward_by_key], forward_by_key
    )
    names: dict[int, tuple[str, str]] = {}
    recomputed: collections.Counter = collections.Counter()
    backward_seen: collections.Counter = collections.Counter()
    for g, fwd_here in zip(gemms, is_forward, strict=True):
        forwards = forward_by_key.get(g.key, [])
        if g.index in in_rule:
            continue
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
            if fwd.index in namer.place:  # where the GEMMs of a rule read it from
                namer.place.setdefault(g.index, namer.place[fwd.index])
        names.setdefault(id(g.eqn), name)  # one jaxpr called twice: its first call's name
    for g, name in _name_rule_gemms(rule, gemms, is_forward, name_of, namer).items():
        names.setdefault(id(g.eqn), name)
    return names, _name_cores(cores, namer)
