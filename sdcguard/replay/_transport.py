"""Moving traces through pipes: a tar into a node, a framed tar out of it.

Traces travel between machines through a launcher such as ``ssh`` over its own stdin/stdout;
nothing opens a port. Into a node (``--reference -``) a trace goes as an uncompressed tar.
Out of a node (``--out -``) it goes as a *framed* tar (:func:`write_trace_frames`): a marker
line with a token chosen by the receiver, length-prefixed frames, an end line. Whatever else
reaches the node's stdout before or after (a login banner, a launcher's messages) is told
apart from the trace and never mistaken for it; the node's own prints go to its stderr.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import tarfile
from collections.abc import Callable
from typing import IO

from sdcguard.replay._trace import CHUNK_NAME, MANIFEST, Trace, TraceError

# --- Moving traces through pipes (launchers) ---------------------------------------------------


def write_tar(trace_dir: str, stream: IO[bytes]) -> None:
    """Writes a trace directory to ``stream`` as an uncompressed tar (manifest first)."""
    with tarfile.open(fileobj=stream, mode="w|") as tar:
        names = sorted(os.listdir(trace_dir), key=lambda n: (n != MANIFEST, n))
        for name in names:
            tar.add(os.path.join(trace_dir, name), arcname=name, recursive=False)


def read_trace_stream(stream: IO[bytes], out: str) -> Trace:
    """Unpacks a trace tar stream into the new directory ``out`` and validates it.

    Only plain files named like trace files are accepted; anything else (links, paths,
    devices) is refused before it touches the disk.
    """
    os.makedirs(out)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                if not member.isfile() or not (
                    member.name == MANIFEST or CHUNK_NAME.match(member.name)
                ):
                    raise TraceError(f"refusing trace stream member {member.name!r}")
                src = tar.extractfile(member)
                with open(os.path.join(out, member.name), "wb") as f:
                    shutil.copyfileobj(src, f)
    except tarfile.TarError as e:
        raise TraceError(f"the trace stream is not a valid tar (truncated?): {e}") from None
    return Trace(out)


# --- The framed stream out of a node (``record --out -``) -------------------------------------

_BEGIN = b"SDCGUARD-TRACE-BEGIN "
_END = b"SDCGUARD-TRACE-END "
_FRAME = struct.Struct(">I")
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_token(token: str) -> bytes:
    """The stream token as bytes; ValueError unless it is 1 to 64 of ``[A-Za-z0-9_-]``."""
    if not _TOKEN.match(token):
        raise ValueError(f"bad stream token {token!r}: 1 to 64 letters, digits, '-' or '_'")
    return token.encode()


class _FrameWriter:
    def __init__(self, stream: IO[bytes]):
        self.stream = stream

    def write(self, data) -> int:
        data = bytes(data)
        if data:  # a zero-length frame ends the stream: never write one here
            self.stream.write(_FRAME.pack(len(data)) + data)
        return len(data)


def write_trace_frames(trace_dir: str, stream: IO[bytes], token: str) -> None:
    """Writes a trace to ``stream`` as a framed tar (see the module docstring).

    Layout: ``SDCGUARD-TRACE-BEGIN <token>\\n``, frames (4-byte big-endian length, bytes) of
    an uncompressed tar, a zero length, ``SDCGUARD-TRACE-END <token>\\n``.
    """
    tok = check_token(token)
    # The newline first: the marker starts a line even after output without a final newline.
    stream.write(b"\n" + _BEGIN + tok + b"\n")
    write_tar(trace_dir, _FrameWriter(stream))
    stream.write(_FRAME.pack(0) + _END + tok + b"\n")
    stream.flush()


class _FrameReader:
    """A file-like view of the frames' payload; ``read`` returns b"" after the last frame."""

    def __init__(self, stream: IO[bytes], pending: bytes):
        self.stream, self.pending, self.left, self.done = stream, bytearray(pending), 0, False

    def _fill(self, n: int) -> bytes:
        while len(self.pending) < n:
            block = _read_some(self.stream)
            if not block:
                raise TraceError("the trace stream ended in the middle (the node stopped?)")
            self.pending += block
        out = bytes(self.pending[:n])
        del self.pending[:n]
        return out

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while not self.done and (n < 0 or len(out) < n):
            if self.left == 0:
                self.left = _FRAME.unpack(self._fill(_FRAME.size))[0]
                if self.left == 0:
                    self.done = True
                    break
            take = self.left if n < 0 else min(self.left, n - len(out))
            out += self._fill(take)
            self.left -= take
        return bytes(out)

    def finish(self, token: bytes) -> bytes:
        """Reads to the end marker; returns what follows it in the buffer."""
        while not self.done:
            if not self.read(1 << 20) and not self.done:
                break
        end = _END + token + b"\n"
        got = self._fill(len(end))
        if got != end:
            raise TraceError("the trace stream has no end marker (truncated or garbled)")
        return bytes(self.pending)


def _read_some(stream: IO[bytes]) -> bytes:
    read1 = getattr(stream, "read1", None)
    return read1(1 << 16) if read1 is not None else stream.read(1 << 16)


def read_trace_frames(
    stream: IO[bytes], out: str, token: str, *, other: Callable[[bytes], None] | None = None
) -> Trace:
    """Reads a framed trace (:func:`write_trace_frames`) from ``stream`` into ``out``.

    Output before the begin marker and after the end marker is passed to ``other`` (a
    launcher's banner, say), and the stream is read to its end, so the writer never blocks.

    Raises:
      TraceError: no begin marker before the stream ended, a broken frame, an invalid trace.
    """
    tok = check_token(token)
    other = other or (lambda _: None)
    begin = _BEGIN + tok + b"\n"
    buf = b""
    while True:
        block = _read_some(stream)
        if not block:
            other(buf)
            raise TraceError("the node's output ended without a trace")
        buf += block
        at = buf.find(begin)
        if at >= 0:
            other(buf[:at])
            buf = buf[at + len(begin) :]
            break
        keep = len(begin) - 1  # a marker may straddle two blocks
        if len(buf) > keep:
            other(buf[:-keep])
            buf = buf[-keep:]
    frames = _FrameReader(stream, buf)
    trace = read_trace_stream(frames, out)
    other(frames.finish(tok))
    while block := _read_some(stream):
        other(block)
    return trace
