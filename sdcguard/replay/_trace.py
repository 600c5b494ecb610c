"""The on-disk trace of one node's run: ``manifest.json`` plus ``arrays-NNNN.npz`` chunks.

A trace is data, never code: JSON and ``.npz`` read with ``allow_pickle=False``. Arrays are
streamed into chunks of about :data:`CHUNK_BYTES` as they are produced, so a large capture
never sits in host memory whole. The trace is written into a hidden temporary directory
beside its destination, every file fsynced, and renamed into place at the end: a crash leaves
no half-written trace under the destination name. The manifest lists every file's sha256 and
every array's shape and dtype, and carries a content hash over all of it; a truncated or
tampered trace is refused (:class:`TraceError`), never half-read.

Temporary directories (a trace being written, a replaced one, a command's work directory) are
named ``PREFIX-<host tag>-<pid>-XXXX``; one left behind by a killed process on this host is
removed by the next run that writes there (:func:`clean_stale`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from typing import Any

import numpy as np

FORMAT = "sdcguard-replay-trace"
VERSION = 2  # 2: the submodule level keeps the values lock-stepped nodes read (sub/ref/)
MANIFEST = "manifest.json"
CHUNK_BYTES = 32 << 20
CHUNK_NAME = re.compile(r"^arrays-\d{4}\.npz$")
_DTYPES = {
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
}
_MAX_MANIFEST_BYTES = 256 << 20


class TraceError(ValueError):
    """A trace is missing, truncated, tampered with, or of an unknown version."""


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "content_hash"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _storable(x) -> np.ndarray:
    a = np.require(np.asarray(x), requirements="C")  # keeps 0-d arrays 0-d
    if a.dtype.name == "bfloat16":  # npz cannot name bfloat16; keep the bits, note the dtype
        return a.view(np.uint16)
    return a


# --- Temporary directories that a killed process leaves behind -----------------------------------


def _host_tag() -> str:
    return hashlib.sha256(platform.node().encode()).hexdigest()[:8]


def private_tmpdir(prefix: str, parent: str | None = None) -> str:
    """``mkdtemp`` named ``PREFIX-<host tag>-<pid>-XXXX``, so :func:`clean_stale` can tell
    when its owner is gone."""
    return tempfile.mkdtemp(prefix=f"{prefix}-{_host_tag()}-{os.getpid()}-", dir=parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def clean_stale(parent: str, prefix: str) -> list[str]:
    """Removes ``parent/PREFIX-<tag>-<pid>-*`` directories of dead processes of this host.

    A directory of another host (a shared file system) or of a live process is left alone;
    so is one whose name does not follow :func:`private_tmpdir`.

    Returns:
      The removed paths.
    """
    pattern = re.compile(re.escape(prefix) + r"-([0-9a-f]{8})-(\d+)-[^/]+$")
    tag, removed = _host_tag(), []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name)
        path = os.path.join(parent, name)
        if m and m.group(1) == tag and not _alive(int(m.group(2))) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _replaceable(path: str) -> bool:
    """Whether ``path`` may be replaced by a new trace: an empty directory or a trace."""
    if not os.path.isdir(path):
        return False
    names = set(os.listdir(path))
    return not names or (
        MANIFEST in names and all(n == MANIFEST or CHUNK_NAME.match(n) for n in names)
    )


def publish(tmp: str, out: str) -> None:
    """Moves the complete trace directory ``tmp`` to ``out``, replacing a trace there.

    The old trace is moved aside first and removed last, so a crash leaves either trace whole
    (or the old one in a ``.NAME.old-*`` directory that :func:`clean_stale` removes).

    Raises:
      TraceError: ``out`` exists and is neither a trace nor an empty directory.
    """
    if os.path.exists(out) and not _replaceable(out):
        raise TraceError(
            f"refusing to write a trace over {out!r}: it exists and is not a trace "
            "(choose a new directory)"
        )
    old = None
    if os.path.exists(out):
        old = private_tmpdir(f".{os.path.basename(out)}.old", os.path.dirname(out))
        os.rename(out, os.path.join(old, "trace"))
    os.rename(tmp, out)
    _fsync_dir(os.path.dirname(out))
    if old:
        shutil.rmtree(old, ignore_errors=True)


def receive_dir(out: str) -> str:
    """A new hidden directory beside ``out`` to receive a trace into (then :func:`publish`).

    Raises:
      TraceError: ``out`` exists and is neither a trace nor an empty directory.
    """
    out = os.path.abspath(out)
    if os.path.exists(out) and not _replaceable(out):
        raise TraceError(
            f"refusing to write a trace over {out!r}: it exists and is not a trace "
            "(choose a new directory)"
        )
    parent, base = os.path.dirname(out), os.path.basename(out)
    os.makedirs(parent, exist_ok=True)
    for kind in ("tmp", "old"):
        clean_stale(parent, f".{base}.{kind}")
    tmp = private_tmpdir(f".{base}.tmp", parent)
    os.rmdir(tmp)  # read_trace_stream creates it
    return tmp


class TraceWriter:
    """Streams arrays into a new trace directory, published atomically by :meth:`finish`.

    Args:
      out: the trace directory to create. An existing trace (or empty directory) there is
        replaced only at the very end, after the new one is complete; anything else there is
        refused.

    Example:
      >>> w = TraceWriter("/tmp/trace")
      >>> w.add("step/loss", np.float32(2.5))
      >>> w.finish({"task": "..."})
    """

    def __init__(self, out: str):
        self.out = os.path.abspath(out)
        if os.path.exists(self.out) and not _replaceable(self.out):
            raise TraceError(
                f"refusing to write a trace over {out!r}: it exists and is not a trace "
                "(choose a new directory)"
            )
        parent = os.path.dirname(self.out)
        os.makedirs(parent, exist_ok=True)
        base = os.path.basename(self.out)
        for kind in ("tmp", "old"):  # left by a killed writer of this trace
            clean_stale(parent, f".{base}.{kind}")
        self.tmp = private_tmpdir(f".{base}.tmp", parent)
        os.chmod(self.tmp, 0o755)  # mkdtemp makes it private; a trace is shared data
        self.arrays: dict[str, dict] = {}
        self.files: dict[str, dict] = {}
        self._chunk: dict[str, np.ndarray] = {}
        self._chunk_bytes = 0

    def add(self, key: str, value) -> None:
        """Adds one array under ``key`` (a ``/``-separated name, unique in the trace)."""
        if key in self.arrays:
            raise ValueError(f"duplicate trace key {key!r}")
        dtype = str(np.asarray(value).dtype)
        a = _storable(value)
        member = f"a{len(self.arrays)}"
        self.arrays[key] = {
            "file": f"arrays-{len(self.files):04d}.npz",
            "member": member,
            "shape": list(a.shape),
            "dtype": dtype,
            # The values alone (no file or time stamps): equal on nodes that computed the same.
            "sha256": hashlib.sha256(a.data if a.size else b"").hexdigest(),
        }
        self._chunk[member] = a
        self._chunk_bytes += a.nbytes
        if self._chunk_bytes >= CHUNK_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._chunk:
            return
        name = f"arrays-{len(self.files):04d}.npz"
        path = os.path.join(self.tmp, name)
        with open(path, "wb") as f:
            np.savez(f, **self._chunk)
            f.flush()
            os.fsync(f.fileno())
        self.files[name] = {"sha256": _sha256_file(path), "bytes": os.path.getsize(path)}
        self._chunk, self._chunk_bytes = {}, 0

    def finish(self, fields: dict[str, Any]) -> dict:
        """Writes the manifest and moves the trace into place; returns the manifest."""
        self._flush()
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            **fields,
            "files": self.files,
            "arrays": self.arrays,
        }
        manifest["content_hash"] = hashlib.sha256(_canonical(manifest)).hexdigest()
        path = os.path.join(self.tmp, MANIFEST)
        with open(path, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.tmp)
        publish(self.tmp, self.out)
        return manifest

    def abort(self) -> None:
        """Removes the unfinished trace."""
        shutil.rmtree(self.tmp, ignore_errors=True)


class Trace:
    """A validated trace directory; arrays are read lazily, one chunk file at a time.

    Raises:
      TraceError: on open, if anything about the trace is wrong (see module docstring).
    """

    def __init__(self, path: str):
        self.path = path
        self.manifest = self._read_manifest()
        self._verify_files()
        self._open: tuple[str, Any] | None = None

    def _read_manifest(self) -> dict:
        path = os.path.join(self.path, MANIFEST)
        if not os.path.isdir(self.path):
            raise TraceError(f"trace directory {self.path!r} does not exist")
        if not os.path.isfile(path):
            raise TraceError(f"{self.path!r} is not a complete trace: it has no {MANIFEST}")
        if os.path.getsize(path) > _MAX_MANIFEST_BYTES:
            raise TraceError(f"{path}: manifest too large")
        try:
            with open(path) as f:
                manifest = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TraceError(f"{path}: not valid JSON (truncated or corrupt): {e}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise TraceError(f"{path}: not an sdcguard replay trace")
        if manifest.get("version") != VERSION:
            raise TraceError(
                f"{path}: trace version {manifest.get('version')!r}; this sdcguard reads "
                f"version {VERSION}"
            )
        expected = hashlib.sha256(_canonical(manifest)).hexdigest()
        if manifest.get("content_hash") != expected:
            raise TraceError(f"{path}: content hash does not match: the manifest was modified")
        for key, entry in manifest.get("arrays", {}).items():
            if (
                entry.get("file") not in manifest.get("files", {})
                or entry.get("dtype") not in _DTYPES | {"bfloat16"}
                or not all(isinstance(n, int) and n >= 0 for n in entry.get("shape", [None]))
            ):
                raise TraceError(f"{path}: bad entry for array {key!r}")
        return manifest

    def _verify_files(self) -> None:
        for name, meta in self.manifest["files"].items():
            if not CHUNK_NAME.match(name):
                raise TraceError(f"{self.path}: unexpected file name {name!r} in the manifest")
            path = os.path.join(self.path, name)
            if not os.path.isfile(path):
                raise TraceError(f"{self.path}: {name} is missing (truncated trace)")
            if os.path.getsize(path) != meta["bytes"]:
                raise TraceError(
                    f"{self.path}: {name} has {os.path.getsize(path)} bytes, the manifest says "
                    f"{meta['bytes']} (truncated or corrupt trace)"
                )
            if _sha256_file(path) != meta["sha256"]:
                raise TraceError(f"{self.path}: {name} does not match its sha256 (corrupt trace)")

    @property
    def content_hash(self) -> str:
        return self.manifest["content_hash"]

    @property
    def data_hash(self) -> str:
        """Hash of the recorded values only (names, shapes, dtypes, bytes of every array).

        Unlike :attr:`content_hash` it leaves out where and when the trace was made (host,
        paths, file time stamps), so nodes that computed the same numbers share it.
        """
        h = hashlib.sha256()
        for key in sorted(self.manifest["arrays"]):
            entry = self.manifest["arrays"][key]
            digest = entry.get("sha256")
            if digest is None:  # a trace written before arrays carried their own hash
                a = _storable(self.get(key))
                digest = hashlib.sha256(a.data if a.size else b"").hexdigest()
            h.update(f"{key}|{entry['dtype']}|{entry['shape']}|{digest}\n".encode())
        return h.hexdigest()

    def __contains__(self, key: str) -> bool:
        return key in self.manifest["arrays"]

    def keys(self, prefix: str = "") -> Iterator[str]:
        return (k for k in self.manifest["arrays"] if k.startswith(prefix))

    def get(self, key: str) -> np.ndarray:
        """The array stored under ``key``, checked against the manifest's shape and dtype."""
        try:
            entry = self.manifest["arrays"][key]
        except KeyError:
            raise TraceError(f"{self.path}: the trace has no array {key!r}") from None
        if self._open is None or self._open[0] != entry["file"]:
            if self._open is not None:
                self._open[1].close()
            try:
                npz = np.load(os.path.join(self.path, entry["file"]), allow_pickle=False)
            except (OSError, ValueError, zipfile.BadZipFile) as e:
                raise TraceError(f"{self.path}: cannot read {entry['file']}: {e}") from None
            self._open = (entry["file"], npz)
        try:
            a = self._open[1][entry["member"]]
        except (KeyError, ValueError, OSError, zipfile.BadZipFile) as e:
            raise TraceError(f"{self.path}: cannot read {key!r}: {e}") from None
        dtype = entry["dtype"]
        if dtype == "bfloat16":
            import ml_dtypes

            a = a.view(ml_dtypes.bfloat16)
        if list(a.shape) != entry["shape"] or str(a.dtype) != dtype:
            raise TraceError(
                f"{self.path}: {key!r} is {a.dtype}{list(a.shape)}, the manifest says "
                f"{dtype}{entry['shape']}"
            )
        return a

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None
