"""Running a node's process and reading its trace back; getting any node's trace.

The protocol with a node's process (``local:N`` and hosts), which cannot deadlock:

* stdin: the reference trace as a tar, written from its own thread, or nothing.
* stdout: the trace as a *framed* stream (:func:`~sdcguard.replay._transport.write_trace_frames`)
  marked with a token this process chooses. Anything else on stdout, before or after the
  trace (an ssh login banner, a launcher's messages), is kept apart, never taken for the
  trace. ``record --out -`` sends everything the task itself prints to stderr.
* stderr: read line by line from its own thread; lines ``sdcguard-progress: {json}`` drive
  the progress display, the others are passed to ``log`` and the last few kept for the error
  message.
* A time-out per node (``timeout``): past it the node's whole process group is killed and
  the error names the node. The parent reads both pipes until they close, so a node never
  blocks on a full pipe.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from sdcguard.replay._nodes import (
    DEFAULT_TIMEOUT,
    Launch,
    Log,
    Node,
    NodeError,
    Progress,
    check_nodes,
    launcher_argv,
    record_argv,
    remote_argv,
)
from sdcguard.replay._record import RecordOptions, open_trace, record_trace
from sdcguard.replay._trace import Trace, TraceError, publish, receive_dir
from sdcguard.replay._transport import read_trace_frames, write_tar

PROGRESS_PREFIX = "sdcguard-progress: "
_TAIL_LINES = 20
DEFAULT_LAUNCH = Launch()  # no launcher, the default remote command and time-out


def _python_command() -> list[str]:
    return [sys.executable, "-m", "sdcguard"]


def _subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # The child must import this very sdcguard, installed or not.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


class Processes:
    """The node processes running now, so that an interrupted command can stop them all.

    Example:
      >>> procs = Processes()
      >>> try:
      ...     run_node(..., processes=procs)
      ... finally:
      ...     procs.kill_all()
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self._closed = False

    def add(self, proc: subprocess.Popen) -> None:
        """Registers a started process; after :meth:`close` it is killed at once instead."""
        with self._lock:
            if not self._closed:
                self._running.add(proc)
                return
        _kill(proc)
        raise NodeError("interrupted")

    def close(self) -> None:
        """Kills every process, and every one registered from now on."""
        with self._lock:
            self._closed = True
        self.kill_all()

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._running.discard(proc)

    def kill_all(self) -> None:
        with self._lock:
            procs = list(self._running)
        for proc in procs:
            _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    """Kills a node's whole process group (the launcher and what it started)."""
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def _keep_tail(buf: bytearray, limit: int = 4096) -> Callable[[bytes], None]:
    """A callback keeping the last ``limit`` bytes it is given in ``buf``."""

    def keep(data: bytes) -> None:
        buf.extend(data)
        del buf[:-limit]

    return keep


def run_process(
    argv: list[str],
    out: str,
    reference: Trace | None,
    *,
    name: str,
    token: str,
    env: dict[str, str] | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    progress: Progress | None = None,
    log: Log | None = None,
    processes: Processes | None = None,
) -> Trace:
    """Runs a ``record --out - --stream-token TOKEN`` process; unpacks its trace into ``out``.

    See the module docstring for the protocol. On any failure ``out`` is removed.

    Args:
      argv: the command (a launcher's argv, or Python's).
      out: the trace directory (received beside it, then moved into place).
      reference: streamed to the process's stdin, or None.
      name: the node, as errors name it.
      token: the stream token passed in ``argv``.
      timeout: seconds until the process group is killed (None: no limit).
      progress: receives the node's ``progress(phase, done, total)``.
      log: receives every other line the node prints on stderr.
      processes: registry of running processes (for interruption).

    Raises:
      NodeError: the process could not start, failed, timed out, or sent no valid trace.
    """
    final, out = out, receive_dir(out)
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if reference else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,  # one process group: a time-out kills it all
        )
    except OSError as e:
        raise NodeError(f"node {name}: cannot start {argv[0]!r}: {e}") from None
    if processes is not None:
        processes.add(proc)
    if progress is not None:
        progress("launched", 0, 1)
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    timed_out = threading.Event()
    threads = [threading.Thread(target=_read_stderr, args=(proc, tail, progress, log), daemon=True)]
    if reference is not None:
        threads.append(threading.Thread(target=_feed, args=(proc, reference), daemon=True))
    for t in threads:
        t.start()

    def expire():
        timed_out.set()
        _kill(proc)

    timer = threading.Timer(timeout, expire) if timeout else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    started = time.monotonic()
    other = bytearray()
    error: TraceError | None = None
    trace = None
    try:
        try:
            trace = read_trace_frames(proc.stdout, out, token, other=_keep_tail(other))
        except TraceError as e:
            error = e
            # Keep reading, so a node that still writes is not blocked; it ends or times out.
            with contextlib.suppress(OSError, ValueError):
                while proc.stdout.read(1 << 16):
                    pass
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        try:
            code = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            expire()
            code = proc.wait()
        for t in threads:
            t.join(timeout=10)
    except BaseException:
        _kill(proc)
        shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        if timer is not None:
            timer.cancel()
        if processes is not None:
            processes.discard(proc)
        for stream in (proc.stdout, proc.stderr, proc.stdin):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
    what = f"{shlex.join(argv[:3])} ..."
    said = _last_line("\n".join(tail)) or _last_line(other.decode("utf-8", "replace"))
    said = f": {said}" if said else ""
    if timed_out.is_set():
        shutil.rmtree(out, ignore_errors=True)
        raise NodeError(
            f"node {name}: no trace within {timeout:g} s (--timeout); stopped {what}{said}"
        )
    if code != 0:
        shutil.rmtree(out, ignore_errors=True)
        raise NodeError(f"node {name}: {what} failed with exit code {code}{said}")
    if error is not None:
        shutil.rmtree(out, ignore_errors=True)
        raise NodeError(f"node {name}: no valid trace from {what}: {error}{said}")
    trace.close()
    try:
        publish(out, final)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    trace.path = os.path.abspath(final)  # validated as received; only its name changed
    return trace


def _feed(proc: subprocess.Popen, reference: Trace) -> None:
    try:
        write_tar(reference.path, proc.stdin)
    except (BrokenPipeError, OSError, ValueError):
        pass  # the child died (or was stopped); its exit status says why
    finally:
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.close()


def _read_stderr(proc, tail, progress: Progress | None, log: Log | None) -> None:
    with contextlib.suppress(OSError, ValueError):
        for raw in proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if line.startswith(PROGRESS_PREFIX):
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    p = json.loads(line[len(PROGRESS_PREFIX) :])
                    if progress is not None:
                        progress(str(p["phase"]), int(p["done"]), int(p["total"]))
                continue
            tail.append(line)
            if log is not None:
                log(line)


def progress_line(phase: str, done: int, total: int) -> str:
    """The stderr line by which a node reports progress to the process that started it."""
    return PROGRESS_PREFIX + json.dumps({"phase": phase, "done": done, "total": total})


def run_node(
    node: Node,
    options: RecordOptions,
    *,
    out: str,
    reference: Trace | None = None,
    launch: Launch = DEFAULT_LAUNCH,
    progress: Progress | None = None,
    log: Log | None = None,
    processes: Processes | None = None,
) -> Trace:
    """Gets ``node``'s trace of ``options`` (recording it, or opening a recorded one).

    Args:
      node: where to run.
      options: what to run.
      out: the new trace's directory (unused for ``trace:`` nodes); a trace there is replaced
        only by a complete new one, and a failed node leaves nothing behind.
      reference: the healthy node's trace (lock-step / synchronisation), or None.
      launch: how processes are started (launcher, remote command, time-out).
      progress, log, processes: see :func:`run_process`.

    Raises:
      NodeError, TaskError, TraceError, ValueError.
    """
    if node.kind == "trace":
        return open_trace(node.value)
    if node.kind == "local":
        # A failed record leaves nothing (and a trace already at ``out`` untouched).
        record_trace(options, out, reference=reference, progress=progress)
        return open_trace(out)
    token = secrets.token_hex(8)
    if node.kind == "device":
        opts = dataclasses.replace(options, device=int(node.value))
        argv = _python_command() + record_argv(opts, reference=reference is not None, token=token)
    else:
        if not launch.launcher:
            check_nodes([str(node)], launch)  # raises: says how to give a launcher
        command = remote_argv(launch.remote_command) + record_argv(
            options, reference=reference is not None, token=token
        )
        argv = launcher_argv(launch.launcher, node.value, command)
    return run_process(
        argv,
        out,
        reference,
        name=str(node),
        token=token,
        env=_subprocess_env(),
        timeout=launch.timeout,
        progress=progress,
        log=log,
        processes=processes,
    )
