"""``sdcguard.checked``: every GEMM of any JAX function, forward and backward, under ABFT.

``checked(fn)`` traces ``fn`` to a jaxpr and evaluates it again with every floating-point
``dot_general`` replaced by the same GEMM followed by its checksum check (detect, correct:
:func:`sdcguard.protection.checksums.check_contraction`). It works on the program, not on the model
code, so it reaches every GEMM whatever wrote it (Flax linen or NNX, Equinox, plain ``jnp``), inside
``jit``, ``scan``, ``while``, ``cond``, ``remat``, ``custom_jvp``/``custom_vjp`` bodies and
``shard_map``; and when ``fn`` is a training step that calls ``jax.grad``, the backward GEMMs that
``grad`` produced are ``dot_general`` s of the same program and are checked too. Attention that
JAX runs as one fused cuDNN kernel (``jax.nn.dot_product_attention(implementation="cudnn")``)
runs through sdcguard's ABFT flash attention, forward and backward
(:mod:`sdcguard.protection.fused_attention`).

Under sharding each device checks the GEMM it computes, on the blocks it holds: inside ``shard_map``
and ``pmap`` the program is already per device; under ``jit`` with ``NamedSharding`` (automatic or
explicit axes) each checked GEMM is partitioned by :mod:`sdcguard.protection.sharding`, and the
counters, one row per device, are summed in one all-reduce at the end of the step.

Each GEMM is a *site*, named by where it is in the user's model (:mod:`sdcguard.protection.naming`):
the module that owns the parameter it reads (``decoder/block_0/mlp/Dense_0:dot_general`` in linen,
``layers/0/attn/q_einsum:dot_general`` in NNX, ``layers[0].mlp.layers[1]:dot_general`` in
Equinox), the attention module for a GEMM of two activations (``layers/0/attn:scores``,
``:context``), else the ``jax.named_scope`` or Python call path; the two gradient GEMMs of a
forward GEMM carry its name with ``.grad_lhs`` / ``.grad_rhs``. :func:`list_sites` lists them,
checked or not, and why; ``ABFTConfig(include=..., exclude=...)`` selects them by glob. The GEMM,
its injection point and its check are :func:`sdcguard.protection.gemm.checked_gemm`.

Why one module: the transform is one interpreter over a jaxpr, one rule per primitive that can hold
a GEMM (``pjit``, ``scan``, ``while``, ``cond``, ``remat``, ``custom_jvp``/``custom_vjp``,
``shard_map``, ``custom_linear_solve``); the rules call each other recursively, so split they
would still be read as one. The mapping of cuDNN attention onto the flash kernel is not part of
that recursion and has its own module; the evaluator only dispatches to it.

Example:
  >>> step = sdcguard.checked(train_step)               # same arguments as train_step
  >>> (state, metrics), report = jax.jit(step)(state, batch)
  >>> report["decoder/block_0/mlp/Dense_0:dot_general.grad_rhs"]   # int32 [4]
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import fnmatch
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jex_core
from jax.flatten_util import ravel_pytree

from sdcguard.fault_model import inject
from sdcguard.protection import checksums, fused_attention, gemm, naming, sharding
from sdcguard.protection.config import NUM_COUNTERS, ABFTConfig, unsafe_checks

__all__ = ["GemmSite", "checked", "list_sites", "total"]

Report = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmSite:
    """One GEMM site of the program: a ``dot_general`` (or several that share a name: a layer
    called in a loop, a recomputation under remat), or a fused kernel that holds GEMMs.

    Attributes:
      name: the site name (what fault plans, ``include``/``exclude`` and the report use).
      direction: ``'forward'``, ``'grad_lhs'`` or ``'grad_rhs'`` (``'backward'`` for the backward
        equation of a fused attention kernel left unchecked, which holds both).
      lhs_shape, rhs_shape, out_shape: the GEMM's shapes (empty for a fused kernel).
      dtype: the operands' dtype (``'bfloat16'``, or ``'bfloat16 x float32'`` when they differ).
      checked: whether ``checked`` verifies it; then it is in every report of the step.
      why_unchecked: ``''`` when checked, else the reason (``'int8 operands'``, ``'excluded by
        include/exclude'``, ``'inside pallas_call, which sdcguard.checked does not open'``, ...).
      implementation: ``'xla'`` or ``'pallas'`` when checked (see
        :func:`sdcguard.protection.gemm.implementation_for`), ``'pallas flash attention
        (mosaic)'`` or ``'(triton)'`` for the sites of cuDNN attention
        (:mod:`sdcguard.protection.fused_attention`), else ``''``.
    """

    name: str
    direction: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    dtype: str
    checked: bool
    why_unchecked: str
    implementation: str = ""


# Primitives that run GEMMs inside one fused kernel (no jaxpr to open): custom calls, cuBLAS and
# cuDNN kernels. A step that uses them has GEMMs the transform cannot see; list_sites says so.
# JAX's cuDNN attention is not among them: it runs through the ABFT flash kernel
# (:mod:`sdcguard.protection.fused_attention`), or is listed with the reason it cannot.
_FUSED_GEMM_PRIMITIVES = ("cudnn", "cublas", "custom_call")


def _selected(name: str, config: ABFTConfig) -> bool:
    included = any(fnmatch.fnmatchcase(name, p) for p in config.include)
    return included and not any(fnmatch.fnmatchcase(name, p) for p in config.exclude)


def _checkable_dtype(dtype) -> bool:
    """Floating point of 16 bits or more: fp16, bf16, fp32, fp64 (fp8 and integers are not)."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 2


def _dtype_name(gemm: naming.Gemm) -> str:
    lhs, rhs = (jnp.dtype(v.aval.dtype).name for v in gemm.eqn.invars[:2])
    return lhs if lhs == rhs else f"{lhs} x {rhs}"


def _why_unchecked(gemm: naming.Gemm, name: str, direction: str, config: ABFTConfig) -> str:
    operands = [v.aval.dtype for v in gemm.eqn.invars[:2]]
    if not all(_checkable_dtype(d) for d in operands):
        # Integer and fp8 GEMMs pass through: the checksum model is for floating GEMMs that
        # accumulate in float32 or wider.
        return f"{_dtype_name(gemm)} operands (integer and fp8 GEMMs pass through)"
    return _why_not_selected(name, direction, config)


def _why_not_selected(name: str, direction: str, config: ABFTConfig) -> str:
    if direction == "forward" and not config.forward:
        return "forward GEMMs not selected (forward=False)"
    if direction != "forward" and not config.backward:
        return "gradient GEMMs not selected (backward=False)"
    if not _selected(name, config):
        return "excluded by include/exclude"
    return ""


def _not_run_checked(jaxpr) -> dict[int, str]:
    """``id(eqn) -> why`` for the dot_generals the evaluator runs unchecked or not at all: in a
    loop's condition, in a primitive it does not open, in the parts of a linear solve that the
    (already differentiated) step does not run."""
    out: dict[int, str] = {}

    def all_in(sub, why):
        cores: list[naming.Gemm] = []
        out.update({id(g.eqn): why for g in naming.collect_gemms(sub, cores=cores)})
        out.update({id(c.eqn): why for c in cores})

    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        if prim == "while":
            all_in(eqn.params["cond_jaxpr"].jaxpr, "in a while loop's condition (run unchecked)")
            out.update(_not_run_checked(eqn.params["body_jaxpr"].jaxpr))
        elif prim == "custom_linear_solve":
            for part, closed in eqn.params["jaxprs"]._asdict().items():
                if closed is None:
                    continue
                if part == "solve":
                    out.update(_not_run_checked(closed.jaxpr))
                else:
                    all_in(
                        closed.jaxpr,
                        f"in custom_linear_solve's {part}, which the step does not run",
                    )
        elif hasattr(_Evaluator, "_" + prim):
            for sub in naming.sub_jaxprs(eqn):
                out.update(_not_run_checked(sub))
        else:
            for sub in naming.sub_jaxprs(eqn):
                all_in(sub, f"inside {prim}, which sdcguard.checked does not open")
    return out


def _fused_gemm_sites(jaxpr, outer: str = "") -> list[GemmSite]:
    """A site for each fused GEMM kernel of the program (cuDNN attention, custom calls)."""
    found = []
    for eqn in jaxpr.eqns:
        stack = "/".join(p for p in (outer, str(eqn.source_info.name_stack)) if p)
        prim = eqn.primitive.name
        if any(k in prim for k in _FUSED_GEMM_PRIMITIVES) and not naming.is_fused_attention(eqn):
            where = "/".join(p for p in stack.split("/") if p and "(" not in p) or "fn"
            found.append(
                GemmSite(
                    name=f"{where}:{prim}",
                    direction="forward",
                    lhs_shape=(),
                    rhs_shape=(),
                    out_shape=tuple(eqn.outvars[0].aval.shape) if eqn.outvars else (),
                    dtype=jnp.dtype(eqn.invars[0].aval.dtype).name if eqn.invars else "",
                    checked=False,
                    why_unchecked=(
                        f"a fused kernel ({prim}) whose GEMMs sdcguard.checked cannot see; use "
                        "the drop-in attention layers or an XLA attention implementation"
                    ),
                )
            )
        for sub in naming.sub_jaxprs(eqn):
            found += _fused_gemm_sites(sub, stack)
    return found


class _Core(NamedTuple):
    """A fused attention equation: where it is, and what runs it."""

    path: str  # the attention module's path (its sites are f"{path}:scores", ...)
    why: str  # why the flash kernel does not run it ('' when it does)
    checked: frozenset[str]  # the names of its sites whose checks run


class _SiteTable(NamedTuple):
    names: dict[int, tuple[str, str]]  # id(eqn) -> (site name, direction)
    why: dict[int, str]  # id(eqn) -> why it runs unchecked ('' when checked)
    sites: list[GemmSite]  # one per name, in program order
    cores: dict[int, _Core]  # id(eqn) -> the fused attention equation's sites


def _core_table(jaxpr, config: ABFTConfig, paths: dict[int, str], not_run: dict[int, str]):
    """``(cores, sites)``: each fused attention equation of ``jaxpr`` (``id(eqn) -> _Core``) and
    the sites ``list_sites`` shows for them: the kernel's sites of an equation the flash kernel
    runs, else one site named after the primitive, unchecked, saying which parameter stops it."""
    cores: dict[int, _Core] = {}
    sites: dict[str, GemmSite] = {}
    for c in naming.collect_attention_cores(jaxpr):
        eqn, path, prim = c.eqn, paths[id(c.eqn)], c.eqn.primitive.name
        dtype = jnp.dtype(eqn.invars[0].aval.dtype).name
        reason = fused_attention.unsupported(eqn)
        why = not_run.get(id(eqn), "")
        if reason:
            why = (
                f"cuDNN fused attention ({prim}) with {reason}, which the ABFT flash kernel "
                "does not run: cuDNN runs it, its GEMMs unchecked; use implementation='xla' "
                "or the drop-in attention layers"
            )
        if why:
            cores[id(eqn)] = _Core(path, why, frozenset())
            name = f"{path}:{prim}"
            out_shape = tuple(eqn.outvars[0].aval.shape)
            sites.setdefault(name, GemmSite(
                name=name, direction="forward" if fused_attention.is_forward(eqn) else "backward",
                lhs_shape=(), rhs_shape=(), out_shape=out_shape, dtype=dtype, checked=False,
                why_unchecked=why,
            ))  # fmt: skip
            continue
        listed = fused_attention.core_sites(eqn, path)
        whys = {s.name: _why_not_selected(s.name, s.direction, config) for s in listed}
        for s in listed:
            if s.partner and not whys[s.name] and whys[s.partner]:
                whys[s.name] = (
                    f"checked only together with {s.partner} (one check of the flash "
                    f"kernel covers both), which is not selected: {whys[s.partner]}"
                )
        checked = frozenset(n for n, w in whys.items() if not w)
        cores[id(eqn)] = _Core(path, "", checked)
        implementation = fused_attention.implementation(eqn)
        for s in listed:
            site = GemmSite(
                name=s.name, direction=s.direction, lhs_shape=s.lhs_shape,
                rhs_shape=s.rhs_shape, out_shape=s.out_shape, dtype=dtype,
                checked=s.name in checked, why_unchecked=whys[s.name],
                implementation=implementation if s.name in checked else "",
            )  # fmt: skip
            if s.name not in sites or (site.checked and not sites[s.name].checked):
                sites[s.name] = site
    return cores, list(sites.values())


def _site_table(jaxpr, config: ABFTConfig, input_paths: Sequence[str] = ()) -> _SiteTable:
    names, core_paths = naming.name_program(jaxpr, input_paths)
    not_run = _not_run_checked(jaxpr)
    implementation = "pallas" if config.implementation == "pallas" else "xla"
    why_by_eqn: dict[int, str] = {}
    sites: dict[str, GemmSite] = {}
    for g in naming.collect_gemms(jaxpr):
        name, direction = names[id(g.eqn)]
        why = not_run.get(id(g.eqn)) or _why_unchecked(g, name, direction, config)
        why_by_eqn[id(g.eqn)] = why
        site = GemmSite(
            name=name,
            direction=direction,
            lhs_shape=g.lhs_shape,
            rhs_shape=g.rhs_shape,
            out_shape=g.out_shape,
            dtype=_dtype_name(g),
            checked=not why,
            why_unchecked=why,
            implementation="" if why else implementation,
        )
        # A name some of whose GEMMs are checked is a checked site (it is in the report).
        if name not in sites or (site.checked and not sites[name].checked):
            sites[name] = site
    cores, core_sites = _core_table(jaxpr, config, core_paths, not_run)
    listed = list(sites.values()) + core_sites + _fused_gemm_sites(jaxpr)
    return _SiteTable(names, why_by_eqn, listed, cores)


def _validate_selection(config: ABFTConfig, names: Sequence[str]) -> None:
    """Every ``include``/``exclude`` pattern must match a site: a typo would otherwise select
    nothing (an unprotected step that looks protected) or exclude nothing, and say nothing."""
    config.validate_for_checked()
    if config.allow_unmatched:
        return
    for field in ("include", "exclude"):
        for pattern in getattr(config, field):
            if pattern != "*" and not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.4)
                raise ValueError(
                    f"ABFTConfig({field}=...) pattern {pattern!r} matches no GEMM site of this "
                    f"function; close matches: {close or 'none'}. Sites are listed by "
                    "sdcguard.list_sites(fn, *args); ABFTConfig(allow_unmatched=True) accepts "
                    "patterns that match nothing here."
                )


# --- Evaluating the program with checked GEMMs --------------------------------------------------


def _zeros() -> jax.Array:
    return jnp.zeros((NUM_COUNTERS,), jnp.int32)


def _varying(x: jax.Array, axes: frozenset) -> jax.Array:
    """``x`` typed as varying over the manual ``axes`` of an enclosing ``shard_map``.

    Counters computed from a device's own data vary across devices; a loop carry that holds
    them must be typed so from its first value on (``check_vma``).
    """
    mat = getattr(jax.typeof(x), "mat", None)
    missing = tuple(sorted(axes - (mat.varying if mat is not None else frozenset())))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _add(total: dict, more: dict) -> dict:
    out = dict(total)
    for site, c in more.items():
        out[site] = out[site] + c if site in out else c
    return out


def _explicit_mesh(aval):
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return mesh if sharding.has_explicit_axes(mesh) else None


def _replicated(x: jax.Array) -> jax.Array:
    """``x`` whole on every device, where its type says it is sharded over explicit axes."""
    mesh = _explicit_mesh(jax.typeof(x))
    if mesh is None:
        return x
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _sharded_as(x: jax.Array, aval) -> jax.Array:
    """``x`` resharded to ``aval``'s sharding over explicit axes (as it is otherwise)."""
    return x if _explicit_mesh(aval) is None else jax.sharding.reshard(x, aval.sharding)


class _Evaluator:
    """Evaluates jaxprs with every selected dot_general checked, returning the counters."""

    def __init__(self, table: _SiteTable, config: ABFTConfig, mesh=None):
        self.names = table.names
        self.why = table.why
        self.cores = table.cores
        self.config = config
        self.per_device: set[str] = set()  # sites whose counters are rows per device
        self.manual_axes: frozenset = frozenset()  # of the shard_map being evaluated
        # The mesh the step's inputs are sharded over under jit (None: unsharded, shard_map,
        # pmap): every GEMM outside shard_map is checked per device, its counters [rows, 4].
        self.mesh = mesh

    @property
    def sharded(self) -> bool:
        """Whether GEMMs here are checked per device with one counter row per device."""
        return self.mesh is not None and not self.manual_axes

    def zeros(self) -> jax.Array:
        """Counters to start a loop's carry with, typed as the loop's counts will be."""
        if self.sharded:
            return sharding.zero_rows(self.mesh)
        return _varying(_zeros(), self.manual_axes)

    def counts_of(self, counts: dict, sites: list[str]) -> list[jax.Array]:
        """``counts`` of ``sites`` in order (zeros where a site did not run), carry-typed."""
        if self.sharded:
            return [counts[s] if s in counts else self.zeros() for s in sites]
        return [_varying(counts.get(s, _zeros()), self.manual_axes) for s in sites]

    def sites_in(self, jaxpr) -> list[str]:
        """The checked sites of ``jaxpr`` and everything nested in it, in a fixed order."""
        out = []
        cores: list[naming.Gemm] = []
        for g in naming.collect_gemms(jaxpr, cores=cores):
            name, _ = self.names[id(g.eqn)]
            if not self.why[id(g.eqn)] and name not in out:
                out.append(name)
        for c in cores:
            checked = self.cores[id(c.eqn)].checked
            out += [n for n in sorted(checked) if n not in out]
        return out

    def run(self, jaxpr, consts: Sequence, args: Sequence) -> tuple[list, dict]:
        env: dict = {}

        def read(v):
            return v.val if isinstance(v, jex_core.Literal) else env[v]

        def write(v, x):
            if not isinstance(v, jex_core.DropVar):
                env[v] = x

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            write(v, x)
        for v, x in zip(jaxpr.invars, args, strict=True):
            write(v, x)
        counts: dict = {}
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            place = source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)
            with place, eqn.ctx.manager:
                outs, eqn_counts = self.eqn(eqn, invals)
            counts = _add(counts, eqn_counts)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, x in zip(eqn.outvars, outs, strict=True):
                write(v, x)
        return [read(v) for v in jaxpr.outvars], counts

    def eqn(self, eqn, invals):
        if naming.is_fused_attention(eqn):
            return self._fused_attention(eqn, invals)
        rule = getattr(self, "_" + eqn.primitive.name, None)
        if rule is not None:
            return rule(eqn, invals)
        # Any other primitive runs as it is; GEMMs inside one that holds jaxprs run unchecked,
        # and list_sites says so (_not_run_checked).
        return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params)), {}

    # dot_general: the GEMM, its injection point and its check.
    def _dot_general(self, eqn, invals):
        name, _ = self.names[id(eqn)]
        lhs, rhs = invals
        why = self.why[id(eqn)]
        params = eqn.primitive.get_bind_params(eqn.params)
        if why:
            out = eqn.primitive.bind(lhs, rhs, **params)
            if all(_checkable_dtype(x.dtype) for x in invals):
                # A fault strikes a GEMM whether or not it is checked: an unchecked floating
                # GEMM keeps its injection point (a campaign's unprotected baseline is
                # ``include=()``).
                out = inject.apply(out, inject.active_plan(like=out), name)
            return out, {}
        spec = checksums.dot_general_to_einsum(lhs.ndim, rhs.ndim, params["dimension_numbers"])
        contraction = checksums.Contraction.parse(spec, lhs.ndim, rhs.ndim)
        mesh = sharding.device_mesh(lhs, rhs) if self.sharded else None
        out, counts = gemm.checked_gemm(
            lhs,
            rhs,
            contraction,
            site=name,
            config=self.config,
            plan=inject.active_plan(like=lhs),
            precision=params.get("precision"),
            preferred_element_type=params.get("preferred_element_type"),
            mesh=mesh,
        )
        out = out.astype(eqn.outvars[0].aval.dtype)
        if mesh is not None and params.get("out_sharding") is not None:
            out = jax.sharding.reshard(out, params["out_sharding"])
        if self.sharded:
            if mesh is None:  # a GEMM of values on no mesh (constants): computed alike everywhere
                counts = sharding.as_rows(counts, self.mesh)
            elif counts.shape[0] != sharding.counter_rows(self.mesh)[0]:
                counts = sharding.as_rows(jnp.sum(counts, axis=0), self.mesh)
            self.per_device.add(name)
        return out, {name: counts}

    # cuDNN attention: through the ABFT flash kernel where it can run it, else as it is.
    def _fused_attention(self, eqn, invals):
        core = self.cores[id(eqn)]
        if core.why:
            return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params)), {}
        forward = fused_attention.is_forward(eqn)
        rule = fused_attention.forward if forward else fused_attention.backward

        def run(*invals):
            return rule(eqn, invals, path=core.path, checked=core.checked, config=self.config)

        if not self.sharded:
            return run(*invals)
        if sharding.has_explicit_axes(self.mesh):
            # The kernel is not partitioned: every device computes the whole attention (as
            # XLA has it under automatic axes, where it replicates the kernel's operands), its
            # outputs resharded as cuDNN's would be.
            whole = jax.sharding.PartitionSpec()
            run = jax.shard_map(
                run, mesh=self.mesh, in_specs=whole, out_specs=whole, check_vma=False
            )
            invals = [_replicated(x) for x in invals]
        outs, counts = run(*invals)
        outs = [_sharded_as(x, v.aval) for x, v in zip(outs, eqn.outvars, strict=True)]
        # Every device computed the same counts: kept once.
        counts = {s: sharding.as_rows(c, self.mesh) for s, c in counts.items()}
        self.per_device.update(counts)
        return outs, counts

    def _custom_linear_solve(self, eqn, invals):
        # The step is already differentiated: what runs is the solve, on its consts and b.
        p = eqn.params
        lengths, jaxprs = p["const_lengths"], p["jaxprs"]
        start = lengths.matvec + lengths.vecmat
        consts = invals[start : start + lengths.solve]
        b = invals[sum(lengths) :]
        return self.run(jaxprs.solve.jaxpr, jaxprs.solve.consts, [*consts, *b])

    # Calls whose bodies are evaluated in line.
    def _inline(self, eqn, invals, closed):
        return self.run(closed.jaxpr, closed.consts, invals)

    def _pjit(self, eqn, invals):
        return self._inline(eqn, invals, eqn.params["jaxpr"])

    def _closed_call(self, eqn, invals):
        return self._inline(eqn, invals, eqn.params["call_jaxpr"])

    def _custom_jvp_call(self, eqn, invals):
        # The step is already differentiated where it needed to be: the primal body is what runs.
        return self._inline(eqn, invals, eqn.params["call_jaxpr"])

    def _custom_vjp_call(self, eqn, invals):
        return self._inline(eqn, invals, eqn.params["call_jaxpr"])

    def _remat2(self, eqn, invals):
        jaxpr = eqn.params["jaxpr"]
        sites = self.sites_in(jaxpr)

        def body(*args):
            outs, counts = self.run(jaxpr, (), args)
            return outs, self.counts_of(counts, sites)

        rematted = jax.checkpoint(
            body, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"]
        )
        outs, counts = rematted(*invals)
        return outs, dict(zip(sites, counts, strict=True))

    def _scan(self, eqn, invals):
        p = eqn.params
        closed = p["jaxpr"]
        n_consts, n_carry = naming.scan_consts_and_carry(p)
        consts, carry, xs = (
            invals[:n_consts],
            invals[n_consts : n_consts + n_carry],
            invals[n_consts + n_carry :],
        )
        sites = self.sites_in(closed.jaxpr)
        per_iteration = self.config.per_iteration

        def body(state, x):
            carry, totals = state
            outs, counts = self.run(closed.jaxpr, closed.consts, [*consts, *carry, *x])
            step = self.counts_of(counts, sites)
            if per_iteration:
                return (outs[:n_carry], totals), (outs[n_carry:], step)
            totals = [t + c for t, c in zip(totals, step, strict=True)]
            return (outs[:n_carry], totals), (outs[n_carry:], [])

        (carry, totals), (ys, per_step) = jax.lax.scan(
            body,
            (list(carry), [self.zeros() for _ in sites]),
            list(xs),
            length=p["length"],
            reverse=p["reverse"],
            unroll=p["unroll"],
        )
        counts = per_step if per_iteration else totals
        if per_iteration and self.sharded:
            counts = [jnp.moveaxis(c, 0, 1) for c in counts]  # the device axis first
        return [*carry, *ys], dict(zip(sites, counts, strict=True))

    def _while(self, eqn, invals):
        p = eqn.params
        cond, body_jaxpr = p["cond_jaxpr"], p["body_jaxpr"]
        n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts = invals[:n_cond], invals[n_cond : n_cond + n_body]
        carry = invals[n_cond + n_body :]
        sites = self.sites_in(body_jaxpr.jaxpr)

        def cond_fun(state):
            # A GEMM in a loop condition is evaluated unchecked (its counters could not leave).
            return jax.core.eval_jaxpr(cond.jaxpr, cond.consts, *cond_consts, *state[0])[0]

        def body_fun(state):
            carry, totals = state
            outs, counts = self.run(body_jaxpr.jaxpr, body_jaxpr.consts, [*body_consts, *carry])
            step = self.counts_of(counts, sites)
            return outs, [t + c for t, c in zip(totals, step, strict=True)]

        carry, totals = jax.lax.while_loop(
            cond_fun, body_fun, (list(carry), [self.zeros() for _ in sites])
        )
        return carry, dict(zip(sites, totals, strict=True))

    def _cond(self, eqn, invals):
        branches = eqn.params["branches"]
        index, operands = invals[0], invals[1:]
        sites = []
        for branch in branches:
            sites += [s for s in self.sites_in(branch.jaxpr) if s not in sites]

        def as_function(branch):
            def run_branch(*ops):
                outs, counts = self.run(branch.jaxpr, branch.consts, ops)
                return outs, self.counts_of(counts, sites)

            return run_branch

        outs, counts = jax.lax.switch(index, [as_function(b) for b in branches], *operands)
        return outs, dict(zip(sites, counts, strict=True))

    def _shard_map(self, eqn, invals):
        p = eqn.params
        jaxpr, mesh = p["jaxpr"], p["mesh"]
        sites = self.sites_in(jaxpr)
        manual = tuple(n for n in mesh.axis_names if n in p["newly_manual_axes"])
        # Counters stay on the device that computed them: one row per device, summed once, with
        # every other counter of the step, when the report is formed.
        row = jax.sharding.PartitionSpec(manual)

        def body(*args):
            outer, self.manual_axes = self.manual_axes, self.manual_axes | set(manual)
            try:
                outs, counts = self.run(jaxpr, (), args)
                return outs, [c[None] for c in self.counts_of(counts, sites)]
            finally:
                self.manual_axes = outer

        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=tuple(p["in_specs"]),
            out_specs=(list(p["out_specs"]), [row] * len(sites)),
            check_vma=p["check_vma"],
            axis_names=set(p["newly_manual_axes"]),
        )
        outs, counts = mapped(*invals)
        self.per_device.update(sites)
        return outs, dict(zip(sites, counts, strict=True))


# --- The transformation --------------------------------------------------------------------------


def _is_array(x) -> bool:
    # ShapeDtypeStruct: list_sites traces abstract arguments (make_jaxpr takes them as is).
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


class _Traced(NamedTuple):
    closed: Any  # the ClosedJaxpr of fn over its array arguments
    rebuild: Callable  # the jaxpr's outputs -> fn's output pytree
    arrays: list  # the array arguments, in the order of the jaxpr's inputs
    paths: list[str]  # each array argument's key path in ``(args, kwargs)``, ``jax.tree_util``'s


def _trace(fn, args, kwargs) -> _Traced:
    """``fn(*args, **kwargs)`` traced to a jaxpr over its array arguments.

    Only arrays are arguments of the traced program; any other leaf (a Python bool, a
    callable, an Equinox module's static field) stays what it is, as under ``eqx.filter_jit``.
    """
    with_paths, in_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [x for _, x in with_paths]
    dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]
    out_tree = []

    def flat_fn(*arrays):
        full = list(leaves)
        for i, x in zip(dynamic, arrays, strict=True):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(in_tree, full)
        out_leaves, tree = jax.tree_util.tree_flatten(fn(*a, **k))
        out_tree.append((tree, [not _is_array(x) for x in out_leaves]))
        return [x for x in out_leaves if _is_array(x)], [x for x in out_leaves if not _is_array(x)]

    arrays = [leaves[i] for i in dynamic]
    static_out = []

    def traced(*arrays):
        outs, static = flat_fn(*arrays)
        static_out.append(static)
        return outs

    closed = jax.make_jaxpr(traced)(*arrays)
    tree, is_static = out_tree[0]

    def rebuild(outs):
        it_dyn, it_static = iter(outs), iter(static_out[0])
        return jax.tree_util.tree_unflatten(
            tree, [next(it_static) if s else next(it_dyn) for s in is_static]
        )

    paths = [jax.tree_util.keystr(with_paths[i][0]) for i in dynamic]
    return _Traced(closed, rebuild, arrays, paths)


def _reduce(counts: dict, per_device: set[str], mesh=None) -> Report:
    """Each site's counters, those kept per device (``[devices, ...]``, from ``shard_map`` or a
    sharded ``jit`` over ``mesh``) summed over the devices in one reduction for the step."""
    out = dict(counts)
    groups: dict = collections.defaultdict(list)
    for s in counts:
        if s in per_device:
            groups[counts[s].shape[0]].append(s)
    for rows in groups.values():
        flat = [counts[s].reshape(counts[s].shape[0], -1) for s in rows]
        sizes = [f.shape[1] for f in flat]
        stacked = jnp.concatenate(flat, axis=1)  # [devices, all counters]
        summed = jnp.sum(stacked, axis=0) if mesh is None else sharding.sum_rows(stacked, mesh)
        for s, part in zip(rows, jnp.split(summed, np.cumsum(sizes)[:-1]), strict=True):
            out[s] = part.reshape(counts[s].shape[1:])
    return out


def _first_trip_only(plan: inject.FaultPlan | None, trip) -> inject.FaultPlan | None:
    """``plan`` on the first computation of a step, inert on its recomputation: a fault plan
    models a transient fault of one computation, which computing again does not meet."""
    if plan is None:
        return None
    return plan._replace(site=jnp.where(trip == 0, plan.site, -1))


def _placeholder(aval) -> jax.Array:
    """Zeros of ``aval`` (shape, dtype, sharding and varying axes): a loop's first carry."""
    sharding_ = getattr(aval, "sharding", None)
    mesh = getattr(sharding_, "mesh", None)
    explicit = mesh is not None and sharding.has_explicit_axes(mesh)
    zeros = jax.lax.full(aval.shape, 0, aval.dtype, sharding=sharding_ if explicit else None)
    varying = getattr(getattr(aval, "mat", None), "varying", frozenset())
    return _varying(zeros, frozenset(varying))


class _Program(NamedTuple):
    traced: _Traced
    table: _SiteTable
    mesh: Any


def _prepare(fn, config: ABFTConfig, args, kwargs) -> _Program:
    traced = _trace(fn, args, kwargs)
    table = _site_table(traced.closed.jaxpr, config, traced.paths)
    _validate_selection(config, [s.name for s in table.sites])
    return _Program(traced, table, sharding.device_mesh(*traced.arrays))


def _run_checked(program: _Program, config: ABFTConfig, inputs=None) -> tuple[list, Report]:
    """The traced step with its GEMMs checked, on ``inputs`` (``(consts, arrays)``; None: the
    traced ones)."""
    evaluator = _Evaluator(program.table, config, mesh=program.mesh)
    traced = program.traced
    consts, arrays = inputs or (traced.closed.consts, traced.arrays)
    outs, counts = evaluator.run(traced.closed.jaxpr, consts, arrays)
    return outs, _reduce(counts, evaluator.per_device, evaluator.mesh)


def _tied_to(trip: jax.Array, xs: Sequence) -> list:
    """``xs`` as values that XLA must take to depend on ``trip`` (an optimization barrier over
    both; non-array leaves pass as they are).

    A loop body that does not depend on its trip number is loop-invariant: XLA hoists all of it
    out of the loop (while-loop invariant code motion), and a second trip would compute nothing
    again. The barrier is opaque to that pass, and costs nothing at run time.
    """
    xs = list(xs)
    at = [i for i, x in enumerate(xs) if isinstance(x, jax.Array | np.ndarray)]
    _, tied = jax.lax.optimization_barrier((trip, [xs[i] for i in at]))
    for i, x in zip(at, tied, strict=True):
        xs[i] = x
    return xs


def _merge_recomputed(first: jax.Array, second: jax.Array, trips) -> jax.Array:
    """Stacked counters after a step computed ``trips`` times (1 or 2): the first
    computation's after one; after two, those of the recomputation if it detected anything,
    else the first computation's detections were transient and recomputing corrected them."""
    second_detected = jnp.sum(second[:, 0]) > 0
    corrected_by_recompute = jnp.asarray([1, 1, 0, 0], jnp.int32)
    recomputed = jnp.where(second_detected, second, first[:, :1] * corrected_by_recompute)
    return jnp.where(trips > 1, recomputed, first)


def _run_recomputing(program: _Program, config: ABFTConfig) -> tuple[list, Report]:
    """The step once, and once more when a check detected anything: one ``while`` loop of
    one or two trips around one copy of the step (a second copy would double compile time).

    Both trips only detect: the in-place fix would add its program to the clean path, and a
    step computed again from the same arguments needs none (a fault met on both trips is
    reported, for the update guard to refuse).
    """
    plan = inject.active_plan()
    detect_only = dataclasses.replace(config, recompute=False, correct=False)

    def attempt(trip):
        # The step's inputs tied to the trip: the body must be computed on each trip.
        consts = list(program.traced.closed.consts)
        tied = _tied_to(trip, [*consts, *program.traced.arrays])
        consts, arrays = tied[: len(consts)], tied[len(consts) :]
        with inject.faults(_first_trip_only(plan, trip)):
            return _run_checked(program, detect_only, (consts, arrays))

    # The step traced once, run by the loop's body: evaluating it twice (for the loop's first
    # carry, then as the body) would trace every check of the step twice.
    closed, (outs_shape, report_shape) = jax.make_jaxpr(attempt, return_shape=True)(jnp.int32(0))
    tree = jax.tree.structure((outs_shape, report_shape))

    def run(trip):
        return jax.tree.unflatten(tree, jax.core.eval_jaxpr(closed.jaxpr, closed.consts, trip))

    if not report_shape:
        # Nothing is checked: nothing can call for a second computation.
        return run(jnp.int32(0))
    # The counters travel stacked, one [sites, NUM_COUNTERS] array: site by site, XLA copies
    # each decision on them (a sum over every site) into every site's fusion.
    flat0, unravel = ravel_pytree({s: _placeholder(a) for s, a in report_shape.items()})

    def stacked(report):
        return ravel_pytree(report)[0].reshape(-1, NUM_COUNTERS)

    def again(carry):
        trip, _, first, _ = carry
        outs, report = run(trip)
        now = stacked(report)
        # The first trip's counters are kept to say what the recomputation corrected. The
        # merged counters are carried too: merged after the loop, XLA copies the merge into the
        # slice of every site's counters (about 20 lines of HLO each).
        first = jnp.where(trip == 0, now, first)
        return trip + 1, outs, first, _merge_recomputed(first, now, trip + 1)

    def go_on(carry):
        trip, _, first, _ = carry
        return (trip == 0) | ((trip == 1) & (jnp.sum(unsafe_checks(first)) > 0))

    outs0 = [_placeholder(a) for a in outs_shape]
    counts0 = flat0.reshape(-1, NUM_COUNTERS)
    _, outs, _, merged = jax.lax.while_loop(go_on, again, (jnp.int32(0), outs0, counts0, counts0))
    return outs, unravel(merged.reshape(-1))


def checked(fn: Callable, config: ABFTConfig | None = None) -> Callable:
    """``fn`` with every floating-point GEMM verified (and repaired) by checksums.

    Every GEMM whose operands are floating point of 16 bits or more (bf16, fp16, fp32, fp64,
    mixed, any ``preferred_element_type``) is checked, forward and backward; integer and fp8
    GEMMs pass through, and :func:`list_sites` says which and why. Each check is branch-free:
    detection and the exact fix of one flagged row per matrix add no control flow (each
    ``while`` or ``conditional`` would be a host sync on XLA:GPU).

    Args:
      fn: any JAX-traceable function; typically a whole training step that calls ``jax.grad``.
      config: checks and repair. ``include`` / ``exclude`` select sites by glob (a pattern that
        matches nothing is an error); ``forward`` / ``backward`` select by direction;
        ``correct=False`` only detects; ``recompute=True`` checks only detect and computes the
        whole of ``fn`` again, once, when a check detected anything (one loop of one or two
        trips per call: a clean call computes ``fn`` once, at the cost of detection);
        ``per_iteration`` keeps one row of counters per ``scan`` iteration.

    Returns:
      A function with ``fn``'s arguments returning ``(fn's outputs, report)``; ``report`` maps
      each checked site to int32 ``[detected, corrected, uncorrectable, nonfinite_input]``
      (``[iterations, 4]`` inside a scan with ``per_iteration``), with no host sync.
      Faults set by :func:`sdcguard.faults` around the call are injected at their sites,
      checked or excluded (``include=()`` checks nothing and keeps every injection point); a
      fault aimed at a site the step does not have makes the step fail, naming it.

    Example:
      >>> out, report = sdcguard.checked(train_step)(state, batch)
      >>> bad = sum(sdcguard.protection.abft.unsafe_checks(c) for c in report.values())
    """
    config = ABFTConfig() if config is None else config
    config.validate_for_checked()

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with inject.recording_injection_points(set()) as points:
            program = _prepare(fn, config, args, kwargs)
            if config.recompute:
                outs, report = _run_recomputing(program, config)
            else:
                outs, report = _run_checked(program, config)
        if not config.allow_unmatched:
            inject.raise_if_unmatched(inject.active_plan(), points)
        return program.traced.rebuild(outs), report

    return run


def total(report: Report) -> jax.Array:
    """int32 ``[4]``: the report's counters summed over sites (and iterations)."""
    out = _zeros()
    for c in report.values():
        out = out + jnp.sum(c.reshape(-1, NUM_COUNTERS), axis=0)
    return out


def list_sites(fn: Callable, *args, config: ABFTConfig | None = None, **kwargs) -> list[GemmSite]:
    """Every GEMM site of ``fn(*args, **kwargs)``, checked or not, in program order.

    Traces ``fn`` only (nothing runs). Arguments may be arrays or ``jax.ShapeDtypeStruct``.

    Example:
      >>> [s.name for s in list_sites(train_step, state, batch) if s.direction == "forward"]
    """
    config = ABFTConfig() if config is None else config
    config.validate_for_checked()
    traced = _trace(fn, args, kwargs)
    return _site_table(traced.closed.jaxpr, config, traced.paths).sites
