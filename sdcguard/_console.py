"""Output shared by the parts and the command line: JSON files, consoles, progress, messages.

A console off a terminal (``| tee``, ``> log``) never wraps or cuts a table at 80 columns, and
:func:`progress` draws bars on a terminal and prints plain lines elsewhere. rich is imported
only when a console is made.

Example:
  >>> console = make_console()
  >>> with progress(console) as bar:
  ...     task = bar.add_task("trials", total=3)
  ...     for _ in range(3):
  ...         bar.advance(task)
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

# The width of a console that is not a terminal: wide enough that no table of sdcguard's
# (site names of deep models, many columns) is ever wrapped or cut. Rich pads nothing to this
# width (tables are as wide as their content), so a log line is as long as what it says.
LOG_WIDTH = 10_000


def one_line(e: BaseException) -> str:
    """An unexpected exception as one line: ``Type: first line of its message``."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def close_matches(name: str, valid: Sequence[str], n: int = 5) -> list[str]:
    """The valid names closest to ``name`` (a typo's likely targets), best first.

    Example:
      >>> close_matches("decoder/block_0/attn:scorez", ["decoder/block_0/attn:scores", "x"])
      ['decoder/block_0/attn:scores']
    """
    return difflib.get_close_matches(name, list(valid), n=n, cutoff=0.6)


def write_json(doc, path: str | os.PathLike) -> None:
    """Writes ``doc`` as JSON to ``path`` atomically: a temporary file beside it, renamed.

    Nothing is left behind on failure (the temporary file is removed); OSError propagates.
    """
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(
        dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.tmp-"
    )
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# --- Output for terminals and logs ---------------------------------------------------------------


def make_console(*, stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr); off a terminal, one that never wraps a table.

    On a terminal, rich fits tables to the window. In a pipe or a file rich would assume 80
    columns and cut long site names (``decoder/block_0/at…``); there the width is
    :data:`LOG_WIDTH`, so every cell is printed whole (and no colour codes are written).
    """
    from rich.console import Console

    console = Console(stderr=stderr)
    if console.is_terminal:
        return console
    return Console(stderr=stderr, width=LOG_WIDTH)


class LineProgress:
    """Progress as plain lines, for a console that is not a terminal (a log, a pipe).

    The same calls as :class:`rich.progress.Progress` that sdcguard uses (``add_task``,
    ``update``, ``advance``). A line is printed when a task starts, when its description
    changes, each time it passes another tenth of its total, and at its end, e.g.
    ``trials: 12/60 (20%), 0:01:05 elapsed``.
    """

    def __init__(self, console: Console):
        self.console = console
        self._tasks: dict[int, dict] = {}

    def add_task(self, description: str, total: float | None = None, completed: float = 0) -> int:
        task_id = len(self._tasks)
        self._tasks[task_id] = {
            "description": description,
            "total": total,
            "completed": completed,
            "tenth": self._tenth(completed, total),
            "start": time.monotonic(),
        }
        self._line(task_id)
        return task_id

    def update(
        self,
        task_id: int,
        *,
        description: str | None = None,
        completed: float | None = None,
        total: float | None = None,
        advance: float | None = None,
    ) -> None:
        task = self._tasks[task_id]
        changed = description is not None and description != task["description"]
        if description is not None:
            task["description"] = description
        if total is not None:
            task["total"] = total
        if completed is not None:
            task["completed"] = completed
        if advance is not None:
            task["completed"] += advance
        tenth = self._tenth(task["completed"], task["total"])
        if changed or tenth > task["tenth"]:
            task["tenth"] = tenth
            self._line(task_id)

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    @staticmethod
    def _tenth(completed: float, total: float | None) -> int:
        return int(10 * completed / total) if total else 0

    def _line(self, task_id: int) -> None:
        task = self._tasks[task_id]
        elapsed = int(time.monotonic() - task["start"])
        clock = f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}"
        done = f"{task['completed']:g}"
        if task["total"]:
            done += f"/{task['total']:g} ({100 * task['completed'] / task['total']:.0f}%)"
        text = f"{task['description'].strip()}: {done}, {clock} elapsed"
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def progress(console: Console) -> Iterator[Progress | LineProgress]:
    """Progress bars on a terminal (gone when done); plain lines on any other console.

    Yields an object with rich's ``add_task(description, total=, completed=)``,
    ``update(task, description=, completed=, total=, advance=)`` and ``advance(task)``.
    """
    if not console.is_terminal:
        yield LineProgress(console)
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    # What, how far, how long, how much longer.
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        yield bar
