"""The sites of a replay task and the submodules ``--sites`` patterns select among."""

from __future__ import annotations

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
