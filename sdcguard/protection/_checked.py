"""``sdcguard.checked``: every GEMM of any JAX function, forward and backward, under ABFT.

The front door of the transform: trace (:mod:`~sdcguard.protection._trace`), name and select
the sites (:mod:`~sdcguard.protection._select`), evaluate with checked GEMMs
(:mod:`~sdcguard.protection._interpret`), or with one recomputation
(:mod:`~sdcguard.protection._recompute`). How it works: docs/protection.md.

Example:
  >>> step = sdcguard.checked(train_step)               # same arguments as train_step
  >>> (state, metrics), report = jax.jit(step)(state, batch)
  >>> report["decoder/block_0/mlp/Dense_0:dot_general.grad_rhs"]   # int32 [4]
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from sdcguard import fault_model as inject
from sdcguard.protection import _sharding as sharding
from sdcguard.protection._config import ABFTConfig, Counts
from sdcguard.protection._interpret import Program, Report, run_checked
from sdcguard.protection._recompute import run_recomputing
from sdcguard.protection._select import GemmSite, site_table, validate_selection
from sdcguard.protection._trace import trace


def _prepare(fn, config: ABFTConfig, args, kwargs, points: dict) -> Program:
    traced = trace(fn, args, kwargs)
    own_points = frozenset(points)  # what tracing fn recorded: its own injection points
    table = site_table(traced.closed.jaxpr, config, traced.paths)
    validate_selection(config, [s.name for s in table.sites])
    return Program(traced, table, sharding.device_mesh(*traced.arrays), own_points)


def checked(fn: Callable, config: ABFTConfig | None = None) -> Callable:
    """``fn`` with every floating-point GEMM verified (and repaired) by checksums.

    Every GEMM with floating-point operands of 16 bits or more is checked, forward and
    backward, with no control flow per check; integer, fp8 and complex GEMMs pass through, and
    :func:`list_sites` says which and why.

    Args:
      fn: any JAX-traceable function; typically a whole training step that calls ``jax.grad``.
      config: checks and repair (:class:`ABFTConfig`: ``include`` / ``exclude`` globs,
        ``forward`` / ``backward``, ``correct``, ``recompute``, ``per_iteration``); default
        ``ABFTConfig()``.

    Returns:
      A function with ``fn``'s arguments returning ``(fn's outputs, report)``; ``report`` maps
      each checked site to int32 ``[detected, corrected, uncorrectable, nonfinite_input]``
      (``[iterations, 4]`` inside a scan with ``per_iteration``), with no host sync.
      Faults set by :func:`sdcguard.faults` around the call are injected at their sites,
      checked or excluded (``include=()`` checks nothing and keeps every injection point). A
      plan's mistakes (a site the step does not have, an index beyond the site's tensor, a bit
      beyond its dtype, an integer or fp8 site) raise ``ValueError`` when the step is traced
      (docs/faults.md, "Mistakes caught when the step is traced").

    Example:
      >>> out, report = sdcguard.checked(train_step)(state, batch)
      >>> bad = sdcguard.protection.unsafe_checks(sdcguard.protection.total(report))
    """
    if not callable(fn):
        raise TypeError(
            f"sdcguard.checked takes the function to check (a training step), got "
            f"{type(fn).__name__}, which is not callable; write sdcguard.checked(step)(*args)"
        )
    config = ABFTConfig() if config is None else config
    config.validate_for_checked()

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with inject.recording_injection_points({}) as points:
            program = _prepare(fn, config, args, kwargs, points)
            if config.recompute:
                outs, report = run_recomputing(program, config)
            else:
                outs, report = run_checked(program, config)
        # Sites without an injection point (integer and fp8 GEMMs), and why.
        not_injected = {s.name: s.why_unchecked for s in program.table.sites if not s.checked}
        inject.raise_if_unmatched(
            inject.active_plan(),
            points,
            not_injected={n: w for n, w in not_injected.items() if n not in points},
            allow_unmatched=config.allow_unmatched,
        )
        return program.traced.rebuild(outs), report

    return run


def total(report: Report) -> jax.Array:
    """The report's counters summed over sites (and scan iterations).

    Args:
      report: :func:`checked`'s report, ``{site: int32 [..., 4]}``.

    Returns:
      int32 ``[4]``: detected, corrected, uncorrectable, nonfinite_input.

    Example:
      >>> tx.update(grads, opt_state, params, abft_uncorrectable=unsafe_checks(total(report)))
    """
    out = Counts.zeros()
    for c in report.values():
        out = out + jnp.sum(Counts.rows(c), axis=0)
    return out


def list_sites(fn: Callable, *args, config: ABFTConfig | None = None, **kwargs) -> list[GemmSite]:
    """Every GEMM site of ``fn(*args, **kwargs)``, checked or not, in program order.

    Traces ``fn`` only (nothing runs). Arguments may be arrays or ``jax.ShapeDtypeStruct``.

    Example:
      >>> [s.name for s in list_sites(train_step, state, batch) if s.direction == "forward"]
    """
    config = ABFTConfig() if config is None else config
    config.validate_for_checked()
    traced = trace(fn, args, kwargs)
    return site_table(traced.closed.jaxpr, config, traced.paths).sites
