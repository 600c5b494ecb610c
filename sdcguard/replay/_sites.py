"""The sites of a replay task and the submodules ``--sites`` patterns select among."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import jax

from sdcguard.fault_model import match_sites
from sdcguard.replay._capture import Programs, selects
from sdcguard.replay._task import load_task


def task_sites(task_name: str, match: str | None = None) -> tuple[list[str], list[str]]:
    """Traces the task (nothing runs) and lists its sites and capturable submodules.

    Args:
      task_name: ``module:function`` returning a :class:`ReplayTask`.
      match: a ``--sites`` pattern; only what it matches is listed.

    Returns:
      ``(sites, submodules)``: what ``--inject`` and ``--arm`` take, and what ``--sites``
      selects among.

    Raises:
      ValueError: ``match`` matches no site and no submodule.
    """
    task = load_task(task_name)
    params = task.check()
    programs = Programs(task)
    batch = task.batch(0)
    sizes = programs.site_sizes(params, jax.eval_shape(task.optimizer.init, params), batch)
    taps = programs.taps(params, batch)
    modules = sorted({t.module for t in taps})
    names = list(sizes)
    if match:
        names = match_sites(match, [*sizes, *(t.name for t in taps if t.name not in sizes)])
        modules = [m for m in modules if selects(match, m)]
        if not names and not modules:
            raise ValueError(f"--match {match!r} matches no site or submodule of the task")
    return names, modules


def unknown_site_message(name: str, sites: Sequence[str], transformed: Sequence[str] = ()) -> str:
    """Why ``name`` is not a site: inside a lifted transform, or unknown (with close names).

    Args:
      name: the site asked for.
      sites: every site of the task.
      transformed: modules called inside a Flax lifted transform
        (:attr:`~sdcguard.replay._capture.Hooks.inside_transforms`).
    """
    module = name.rpartition(":")[0]
    inside = next((m for m in transformed if module == m or module.startswith(m + "/")), None)
    if inside is not None:
        return (
            f"site {name!r} is in module {inside!r}, which runs inside a Flax lifted "
            "transform (nn.scan, nn.remat, nn.vmap...): its body is traced apart from the "
            "program (a scan's more than once, and run once per layer), so replay neither "
            "taps nor injects there; inject at a site outside it, or at its parameters' "
            "gradients and updates; `sdcguard sites` lists every site of the task"
        )
    close = difflib.get_close_matches(name, list(sites), n=3, cutoff=0.6)
    hint = f" (close: {', '.join(close)})" if close else ""
    return f"unknown site {name!r}{hint}; `sdcguard sites` lists every site of the task"
