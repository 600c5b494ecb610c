"""Which GEMM sites ``checked`` verifies, and why the others run unchecked.

:func:`site_table` names every GEMM of a traced program (:mod:`sdcguard.protection._naming`),
decides for each whether it is checked (dtype, direction, ``include``/``exclude``, where it
sits), and lists the fused kernels whose GEMMs no jaxpr shows: the rows of ``list_sites``.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp

from sdcguard.fault_model import site_matches
from sdcguard.protection import _fused_attention as fused_attention
from sdcguard.protection._config import ABFTConfig
from sdcguard.protection._contraction import empty_gemm
from sdcguard.protection._naming import name_program
from sdcguard.protection._walk import (
    Gemm,
    collect_attention_cores,
    collect_gemms,
    is_fused_attention,
    sub_jaxprs,
)

# Primitives holding jaxprs that the interpreter (:mod:`sdcguard.protection._interpret`) opens,
# one rule each, and checks the GEMMs of; GEMMs inside any other primitive run unchecked.
OPENED_PRIMITIVES = frozenset(
    {
        "jit",
        "closed_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "remat2",
        "scan",
        "while",
        "cond",
        "shard_map",
        "custom_linear_solve",
    }
)


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
      iterations: how many times the GEMM runs per step inside ``scan`` loops (the product of
        their lengths; 1 outside any), or None inside a ``while`` loop: the report's counts of
        the site add up over them (``ABFTConfig(per_iteration=True)``: one row per iteration
        of the innermost scan), and a fault planned at the site fires in every iteration.
      implementation: ``'xla'`` or ``'pallas'`` when checked (see
        :func:`~sdcguard.protection._gemm.implementation_for`), ``'pallas flash attention
        (mosaic)'`` or ``'(triton)'`` for the sites of cuDNN attention
        (:mod:`sdcguard.protection._fused_attention`), else ``''``.
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
    iterations: int | None = 1


def _iterations(jaxpr, times: int | None = 1, out: dict | None = None) -> dict[int, int | None]:
    """``id(eqn) -> iterations`` for every equation under a loop (see :class:`GemmSite`)."""
    out = {} if out is None else out
    for eqn in jaxpr.eqns:
        here = times
        if eqn.primitive.name == "scan":
            here = None if times is None else times * int(eqn.params["length"])
        elif eqn.primitive.name == "while":
            here = None
        if here != 1:
            out[id(eqn)] = here
        for sub in sub_jaxprs(eqn):
            _iterations(sub, here, out)
    return out


# Primitives that run GEMMs inside one fused kernel (no jaxpr to open): custom calls, cuBLAS and
# cuDNN kernels. A step that uses them has GEMMs the transform cannot see; list_sites says so.
# JAX's cuDNN attention is not among them: it runs through the ABFT flash kernel
# (:mod:`sdcguard.protection._fused_attention`), or is listed with the reason it cannot.
_FUSED_GEMM_PRIMITIVES = ("cudnn", "cublas", "custom_call")


def _selected(name: str, config: ABFTConfig) -> bool:
    included = any(site_matches(p, name) for p in config.include)
    return included and not any(site_matches(p, name) for p in config.exclude)


def checkable_dtype(dtype) -> bool:
    """Real floating point of 16 bits or more: fp16, bf16, fp32, fp64 (fp8, integers and
    complex numbers are not)."""
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 2


def _dtype_name(gemm: Gemm) -> str:
    lhs, rhs = (jnp.dtype(v.aval.dtype).name for v in gemm.eqn.invars[:2])
    return lhs if lhs == rhs else f"{lhs} x {rhs}"


def _why_unchecked(gemm: Gemm, name: str, direction: str, config: ABFTConfig) -> str:
    operands = [v.aval.dtype for v in gemm.eqn.invars[:2]]
    if not all(checkable_dtype(d) for d in operands):
        # Integer, fp8 and complex GEMMs pass through: the checksum model is for real floating
        # GEMMs that accumulate in float32 or wider.
        return f"{_dtype_name(gemm)} operands (integer, fp8 and complex GEMMs pass through)"
    if not empty_gemm(gemm.lhs_shape, gemm.rhs_shape):
        return _why_not_selected(name, direction, config)
    return (
        f"zero-size operands {gemm.lhs_shape} x {gemm.rhs_shape}: no GEMM runs (the output is "
        "empty, or zeros where nothing is contracted)"
    )


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
        cores: list[Gemm] = []
        out.update({id(g.eqn): why for g in collect_gemms(sub, cores=cores)})
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
        elif prim in OPENED_PRIMITIVES:
            for sub in sub_jaxprs(eqn):
                out.update(_not_run_checked(sub))
        else:
            for sub in sub_jaxprs(eqn):
                all_in(sub, f"inside {prim}, which sdcguard.checked does not open")
    return out


def _fused_gemm_sites(jaxpr) -> list[GemmSite]:
    """A site for each fused kernel of the program whose GEMMs no jaxpr shows (custom calls,
    cuBLAS and cuDNN kernels other than attention). All run unchecked; names repeated are
    numbered in program order, as GEMMs' are (``fn:custom_call_1``)."""
    seen: dict[str, int] = {}
    unique = []
    for site in _unchecked_kernels(jaxpr):
        n = seen.get(site.name, 0)
        seen[site.name] = n + 1
        unique.append(dataclasses.replace(site, name=f"{site.name}_{n}") if n else site)
    return unique


def _unchecked_kernels(jaxpr, outer: str = "") -> list[GemmSite]:
    found = []
    for eqn in jaxpr.eqns:
        stack = "/".join(p for p in (outer, str(eqn.source_info.name_stack)) if p)
        prim = eqn.primitive.name
        why = ""
        if any(k in prim for k in _FUSED_GEMM_PRIMITIVES) and not is_fused_attention(eqn):
            why = (
                f"a fused kernel ({prim}) whose GEMMs sdcguard.checked cannot see; use "
                "the drop-in attention layers or an XLA attention implementation"
            )
        if why:
            where = "/".join(p for p in stack.split("/") if p and "(" not in p) or "fn"
            found.append(
                GemmSite(
                    name=f"{where}:{prim}",
                    direction="backward" if "transpose(" in stack else "forward",
                    lhs_shape=tuple(eqn.invars[0].aval.shape) if eqn.invars else (),
                    rhs_shape=tuple(eqn.invars[1].aval.shape) if len(eqn.invars) > 1 else (),
                    out_shape=tuple(eqn.outvars[0].aval.shape) if eqn.outvars else (),
                    dtype=jnp.dtype(eqn.invars[0].aval.dtype).name if eqn.invars else "",
                    checked=False,
                    why_unchecked=why,
                )
            )
        for sub in sub_jaxprs(eqn):
            found += _unchecked_kernels(sub, stack)
    return found


class Core(NamedTuple):
    """A fused attention equation: where it is, and what runs it."""

    path: str  # the attention module's path (its sites are f"{path}:scores", ...)
    why: str  # why the flash kernel does not run it ('' when it does)
    checked: frozenset[str]  # the names of its sites whose checks run


class SiteTable(NamedTuple):
    names: dict[int, tuple[str, str]]  # id(eqn) -> (site name, direction)
    why: dict[int, str]  # id(eqn) -> why it runs unchecked ('' when checked)
    sites: list[GemmSite]  # one per name, in program order
    cores: dict[int, Core]  # id(eqn) -> the fused attention equation's sites


def _core_table(jaxpr, config: ABFTConfig, paths: dict[int, str], not_run: dict[int, str]):
    """``(cores, sites)``: each fused attention equation of ``jaxpr`` (``id(eqn) -> Core``) and
    the sites ``list_sites`` shows for them: the kernel's sites of an equation the flash kernel
    runs, else one site named after the primitive, unchecked, saying which parameter stops it."""
    cores: dict[int, Core] = {}
    sites: dict[str, GemmSite] = {}
    for c in collect_attention_cores(jaxpr):
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
            cores[id(eqn)] = Core(path, why, frozenset())
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
        cores[id(eqn)] = Core(path, "", checked)
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


def site_table(jaxpr, config: ABFTConfig, input_paths: Sequence[str] = ()) -> SiteTable:
    names, core_paths = name_program(jaxpr, input_paths)
    not_run = _not_run_checked(jaxpr)
    implementation = "pallas" if config.implementation == "pallas" else "xla"
    why_by_eqn: dict[int, str] = {}
    sites: dict[str, GemmSite] = {}
    iterations = _iterations(jaxpr)
    for g in collect_gemms(jaxpr):
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
            # A grouped GEMM or a convolution is checked on the XLA path whatever the
            # implementation.
            implementation="" if why else (implementation if g.kind == "dot_general" else "xla"),
            iterations=iterations.get(id(g.eqn), 1),
        )
        # A name some of whose GEMMs are checked is a checked site (it is in the report).
        if name not in sites or (site.checked and not sites[name].checked):
            sites[name] = site
    cores, core_sites = _core_table(jaxpr, config, core_paths, not_run)
    listed = list(sites.values()) + core_sites + _fused_gemm_sites(jaxpr)
    return SiteTable(names, why_by_eqn, listed, cores)


def validate_selection(config: ABFTConfig, names: Sequence[str]) -> None:
    """Every ``include``/``exclude`` pattern must match a site: a typo would otherwise select
    nothing (an unprotected step that looks protected) or exclude nothing, and say nothing."""
    config.validate_for_checked()
    if config.allow_unmatched:
        return
    for field in ("include", "exclude"):
        for pattern in getattr(config, field):
            if pattern != "**" and not any(site_matches(pattern, n) for n in names):
                close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.4)
                raise ValueError(
                    f"ABFTConfig({field}=...) pattern {pattern!r} matches no GEMM site of this "
                    f"function; close matches: {close or 'none'}. '*' stops at '/' and ':', "
                    "'**' crosses them (e.g. '**attn**'); sites are listed by "
                    "sdcguard.list_sites(fn, *args); ABFTConfig(allow_unmatched=True) accepts "
                    "patterns that match nothing here."
                )
