"""Erasure-coded in-memory snapshots of sharded state (REFT): lose a host, keep the snapshot.

A snapshot of a sharded train state lives in the memory of the hosts that hold the shards: each
host keeps its own shards and, besides them, parity computed with ``zfec`` (Reed-Solomon over
GF(2^8)) from the other hosts' shards, so that the group rebuilds the snapshot bit-exact after
the loss of any ``tolerate`` hosts' memory, without reading storage.

Layout (RAID-6-like rotation, ``n`` hosts, ``f = tolerate``, ``k = n - f``): every host's
bytes are cut into ``k`` chunks of ``c`` bytes. There are ``n`` stripes; stripe ``s`` takes
one chunk from each of the ``k`` hosts ``s + f, ..., s + n - 1`` (mod ``n``) and its ``f``
parity blocks are kept by hosts ``s, ..., s + f - 1``. Every host is a data host of ``k``
stripes and a parity host of ``f``, so it keeps ``f`` parity blocks of ``c`` bytes: parity
memory ``f / k`` of the data (1/7 = 14.3% for 8 hosts and one lost host), and no stripe has
two blocks on one host, so ``f`` lost hosts cost each stripe at most ``f`` of its ``n`` blocks.

What a host owns: for each ``jax.Array`` leaf, the shards on its device; a shard that several
devices hold (a replicated leaf) is kept once, by the one of them with the least snapshot
memory so far, and so are host-side leaves (numpy, Python scalars). The layout record
(shapes, where each piece lies, one fingerprint of each host's bytes) is small and kept by
every host.

In this one-machine simulation each device of the state's shardings is a host, and a host's
memory is a pair of numpy buffers of this process: :meth:`CodedSnapshot.lose` drops them, and
:meth:`CodedSnapshot.restore` rebuilds what is missing from the others. On a cluster each host
would encode only after receiving the chunks of its stripes from their hosts (network traffic
of about ``f / k`` of the snapshot per host), which this simulation does not show.

Example:
  >>> ring = SnapshotRing(keep=2, erasure=ErasureCode(tolerate=1))
  >>> ring.take(sharded_state, step=100)
  >>> ring.wait()
  >>> ring.latest().lose(3)                 # host 3's memory is gone
  >>> state, snap = ring.restore()          # rebuilt from the other 7 hosts, bit-exact
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np

from sdcguard.recovery._extra import require
from sdcguard.recovery._integrity import (
    LeafRecipe,
    SnapshotCorrupted,
    host_fingerprint,
    leaf_paths,
    rebuild_leaf,
)


def _zfec():
    """``zfec``, imported on first use (the ``recovery`` extra)."""
    return require("zfec", "ErasureCode (erasure-coded snapshots)")


class SnapshotLost(SnapshotCorrupted):
    """More hosts lost their snapshot memory than the code can rebuild.

    A :class:`~sdcguard.recovery.SnapshotCorrupted`, so a rollback falls back past it to an
    older snapshot or a checkpoint, as it does past a corrupt one.
    """


class HostMemory(NamedTuple):
    """What one host keeps of a snapshot: its own shards' bytes and its parity blocks.

    data: uint8 ``[L_h]``, the host's pieces back to back (read-only).
    parity: uint8 ``[f, c]``, its parity block of each stripe it is a parity host of.
    """

    data: np.ndarray
    parity: np.ndarray


class _Piece(NamedTuple):
    """One stored shard: where it lies in its leaf and in its host's bytes."""

    host: int
    index: tuple[tuple[int, int], ...]  # (start, stop) per dimension of the leaf
    offset: int
    nbytes: int


class _LeafLayout(NamedTuple):
    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: tuple[_Piece, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ErasureCode:
    """Erasure coding of in-memory snapshots across the hosts that hold the state.

    Attributes:
      tolerate: how many hosts may lose their snapshot memory at once (``f``); the code is
        ``k``-of-``n`` with ``k = n - f`` for ``n`` hosts. Parity memory is ``f / k`` of the
        snapshot.

    Example:
      >>> SnapshotRing(keep=3, erasure=ErasureCode(tolerate=2))
    """

    tolerate: int = 1

    def __post_init__(self):
        if self.tolerate < 1:
            raise ValueError(f"tolerate must be >= 1 host, got {self.tolerate}")
        _zfec()  # missing: fail here, not in the snapshot thread

    def snapshot(self, step: int, meta: dict, leaves, recipes, treedef) -> CodedSnapshot:
        """Copies each host's shards to host memory and adds the parity (blocking).

        Called by :class:`sdcguard.recovery.SnapshotRing` in its background thread with the
        storable leaves of a state (``jax.Array`` or numpy) and how to rebuild them.

        Raises:
          ValueError: the state is held by fewer than ``tolerate + 1`` devices.
        """
        hosts = _hosts(leaves)
        n, f = len(hosts), self.tolerate
        if n <= f:
            raise ValueError(
                f"erasure coding to survive {f} lost hosts needs the state on at least {f + 1} "
                f"devices; it is on {n} ({hosts}). Shard the state (or replicate it) over more "
                "devices, or lower ErasureCode(tolerate=...)"
            )
        position = {device: h for h, device in enumerate(hosts)}
        # Where every piece goes first, then one copy of each straight into its host's buffer.
        sizes = [0] * n
        plan = []
        for x in leaves:
            itemsize = np.dtype(x.dtype).itemsize
            rows = []
            for host, index, source in _owned_pieces(x, position, sizes):
                nbytes = itemsize * int(np.prod([b - a for a, b in index], dtype=np.int64))
                rows.append((host, index, source, sizes[host], nbytes))
                sizes[host] += nbytes
            plan.append(rows)
        memory = [np.empty((size,), np.uint8) for size in sizes]
        layouts = []
        for x, rows in zip(leaves, plan, strict=True):
            dtype = np.dtype(x.dtype)
            pieces = []
            for host, index, source, offset, nbytes in rows:
                target = memory[host][offset : offset + nbytes]
                target[...] = np.ascontiguousarray(np.asarray(source)).reshape(-1).view(np.uint8)
                pieces.append(_Piece(host, index, offset, nbytes))
            layouts.append(_LeafLayout(tuple(np.shape(x)), dtype, tuple(pieces)))
        for m in memory:
            m.setflags(write=False)
        k = n - f
        chunk = max(1, -(-max(sizes) // k))
        snapshot = CodedSnapshot(
            step=int(step),
            meta=dict(meta),
            hosts=tuple(hosts),
            tolerate=f,
            chunk=chunk,
            _layouts=tuple(layouts),
            _recipes=tuple(recipes),
            _treedef=treedef,
            _memory=[HostMemory(m, np.zeros((0, chunk), np.uint8)) for m in memory],
            _fingerprints=tuple(_bytes_fingerprint(m) for m in memory),
        )
        snapshot._encode_parity()
        return snapshot


def _bytes_fingerprint(data: np.ndarray) -> np.ndarray:
    """uint32 ``[4]``: :func:`~sdcguard.recovery.host_fingerprint` of a host's bytes, read as
    32-bit words, and of the last ``len % 4`` bytes. One pass over a host's memory."""
    words = data.size // 4 * 4
    return np.concatenate(
        [host_fingerprint(data[:words].view(np.uint32)), host_fingerprint(data[words:])]
    )


def _hosts(leaves) -> list[int]:
    """Device ids of every array leaf, sorted: the hosts of the group."""
    devices = set()
    for x in leaves:
        if isinstance(x, jax.Array):
            devices.update(d.id for d in x.sharding.device_set)
    return sorted(devices) or [jax.devices()[0].id]


def _owned_pieces(x, position: dict[int, int], sizes: list[int]):
    """``(host, index, data)`` of each distinct shard of leaf ``x``, one copy each (``data``
    still on its device, or a numpy array).

    A shard held by several devices (a replicated leaf) is kept by the one of them with the
    fewest bytes so far (``sizes``), which keeps the hosts' memory even, and with it the
    chunk size that sets the parity. Numpy leaves belong to the least-loaded host.
    """
    if not isinstance(x, jax.Array):
        data = np.asarray(x)
        yield int(np.argmin(sizes)), tuple((0, s) for s in data.shape), data
        return
    holders: dict[tuple, list] = {}
    for shard in x.addressable_shards:
        index = tuple(
            (sl.start or 0, x.shape[d] if sl.stop is None else sl.stop)
            for d, sl in enumerate(shard.index)
        )
        holders.setdefault(index, []).append(shard)
    for index, shards in holders.items():
        shard = min(shards, key=lambda s: sizes[position[s.device.id]])
        yield position[shard.device.id], index, shard.data


@dataclasses.dataclass(eq=False)
class CodedSnapshot:
    """An erasure-coded snapshot: each host's shards and parity, in that host's memory.

    Duck-types :class:`sdcguard.recovery.Snapshot` (``step``, ``meta``, ``paths``,
    :meth:`verify`, :meth:`restore`), so :class:`~sdcguard.recovery.SnapshotRing` and
    :func:`~sdcguard.recovery.train_with_recovery` use it unchanged.

    Attributes:
      step, meta: as for a plain snapshot.
      hosts: device id of each host, in group order.
      tolerate: hosts that may be lost at once.
      chunk: bytes per chunk (``c``).
    """

    step: int
    meta: dict
    hosts: tuple[int, ...]
    tolerate: int
    chunk: int
    _layouts: tuple[_LeafLayout, ...]
    _recipes: tuple[LeafRecipe, ...]
    _treedef: Any
    _memory: list[HostMemory | None]
    _fingerprints: tuple[np.ndarray, ...]  # of each host's data bytes, taken when copied

    # --- layout ---

    @property
    def n(self) -> int:
        return len(self.hosts)

    @property
    def k(self) -> int:
        return self.n - self.tolerate

    def _stripe(self, s: int) -> tuple[list[int], list[int]]:
        """(data hosts in block order, parity hosts in block order) of stripe ``s``."""
        n, f = self.n, self.tolerate
        return [(s + f + j) % n for j in range(self.k)], [(s + i) % n for i in range(f)]

    def _chunk_of(self, host: int, s: int) -> int:
        """Which of ``host``'s chunks stripe ``s`` holds (``host`` is one of its data hosts)."""
        data_stripes = [t for t in range(self.n) if host in self._stripe(t)[0]]
        return data_stripes.index(s)

    def _chunk(self, data: np.ndarray, j: int) -> np.ndarray:
        block = data[j * self.chunk : (j + 1) * self.chunk]
        if block.size < self.chunk:  # the tail of a host's bytes, padded with zeros
            block = np.concatenate([block, np.zeros((self.chunk - block.size,), np.uint8)])
        return block

    def _encode_parity(self) -> None:
        """Computes every host's parity blocks from the data of its stripes' hosts."""
        encoder = _zfec().Encoder(self.k, self.n)
        parity = [np.zeros((self.tolerate, self.chunk), np.uint8) for _ in self.hosts]
        for s in range(self.n):
            data_hosts, parity_hosts = self._stripe(s)
            blocks = tuple(
                self._chunk(self._memory[h].data, self._chunk_of(h, s)) for h in data_hosts
            )
            encoded = encoder.encode(blocks, tuple(range(self.k, self.n)))
            for i, h in enumerate(parity_hosts):
                parity[h][self._parity_slot(h, s)] = np.frombuffer(encoded[i], np.uint8)
        for h, p in enumerate(parity):
            p.setflags(write=False)
            self._memory[h] = self._memory[h]._replace(parity=p)

    def _parity_slot(self, host: int, s: int) -> int:
        return [t for t in range(self.n) if host in self._stripe(t)[1]].index(s)

    # --- memory ---

    @property
    def lost(self) -> tuple[int, ...]:
        """Hosts (group positions) whose memory of this snapshot is gone."""
        return tuple(h for h, m in enumerate(self._memory) if m is None)

    def memory(self, host: int) -> HostMemory | None:
        """What host ``host`` (group position) keeps; None once lost."""
        return self._memory[host]

    def nbytes(self) -> tuple[int, int]:
        """``(data, parity)`` bytes kept over all hosts that still have theirs."""
        kept = [m for m in self._memory if m is not None]
        return sum(m.data.size for m in kept), sum(m.parity.size for m in kept)

    def lose(self, *hosts: int) -> None:
        """Drops the memory of ``hosts`` (group positions): a simulated host failure."""
        for h in hosts:
            if not 0 <= h < self.n:
                raise ValueError(f"host must be in [0, {self.n}), got {h}")
            self._memory[h] = None

    def _data_of(self, host: int, rebuilt: dict[int, np.ndarray]) -> np.ndarray:
        memory = self._memory[host]
        return memory.data if memory is not None else rebuilt[host]

    def _rebuild_lost(self) -> dict[int, np.ndarray]:
        """The data bytes of every lost host, decoded from the others' data and parity."""
        lost = self.lost
        if not lost:
            return {}
        if len(lost) > self.tolerate:
            raise SnapshotLost(
                f"snapshot of step {self.step}: hosts {list(lost)} (devices "
                f"{[self.hosts[h] for h in lost]}) lost their memory, but this code rebuilds at "
                f"most {self.tolerate}; restore an older snapshot or an Orbax checkpoint "
                "(CheckpointTier), and use ErasureCode(tolerate=...) for more"
            )
        sizes = {h: self._data_size(h) for h in lost}
        chunks = {h: [None] * self.k for h in lost}
        decoder = _zfec().Decoder(self.k, self.n)
        for s in range(self.n):
            data_hosts, parity_hosts = self._stripe(s)
            missing = [h for h in data_hosts if h in sizes]
            if not missing:
                continue
            blocks, numbers = [], []
            for j, h in enumerate(data_hosts):
                if self._memory[h] is not None:
                    blocks.append(self._chunk(self._memory[h].data, self._chunk_of(h, s)))
                    numbers.append(j)
            for i, h in enumerate(parity_hosts):
                if self._memory[h] is not None:
                    blocks.append(self._memory[h].parity[self._parity_slot(h, s)])
                    numbers.append(self.k + i)
            primary = decoder.decode(tuple(blocks[: self.k]), tuple(numbers[: self.k]))
            for h in missing:
                chunks[h][self._chunk_of(h, s)] = np.frombuffer(
                    primary[data_hosts.index(h)], np.uint8
                )
        return {h: np.concatenate(chunks[h])[: sizes[h]] for h in lost}

    def _data_size(self, host: int) -> int:
        return sum(p.nbytes for layout in self._layouts for p in layout.pieces if p.host == host)

    def rebuild(self) -> None:
        """Gives every lost host its memory back (data decoded, parity encoded again), as a
        replacement host would receive it; the snapshot survives ``tolerate`` more losses."""
        rebuilt = self._rebuild_lost()
        if not rebuilt:
            return
        self._check(rebuilt)  # before trusting the rebuilt bytes
        for h, data in rebuilt.items():
            data.setflags(write=False)
            self._memory[h] = HostMemory(data, np.zeros((self.tolerate, self.chunk), np.uint8))
        self._encode_parity()

    # --- the Snapshot interface ---

    @property
    def paths(self) -> list[str]:
        """The key path of every leaf (as ``jax.tree_util.keystr`` writes it)."""
        return leaf_paths(self._treedef)

    def _leaves(self, rebuilt: dict[int, np.ndarray]) -> list[np.ndarray]:
        """Every leaf as a host array, assembled from its pieces, after verifying every host."""
        self._check(rebuilt)
        leaves = [np.empty(layout.shape, layout.dtype) for layout in self._layouts]
        for leaf, layout in zip(leaves, self._layouts, strict=True):
            for piece in layout.pieces:
                raw = self._data_of(piece.host, rebuilt)[piece.offset : piece.offset + piece.nbytes]
                shape = tuple(stop - start for start, stop in piece.index)
                leaf[tuple(slice(a, b) for a, b in piece.index)] = raw.view(layout.dtype).reshape(
                    shape
                )
        return leaves

    def _check(self, rebuilt: dict[int, np.ndarray]) -> None:
        """Every host's bytes against their fingerprint, kept ones first: a corrupt surviving
        host also spoils what is decoded with its bytes, and the error names the host at
        fault."""
        for host in sorted(range(self.n), key=lambda h: h in rebuilt):
            data = self._data_of(host, rebuilt)
            if not np.array_equal(_bytes_fingerprint(data), self._fingerprints[host]):
                raise self._corrupt(host, host in rebuilt)

    def _corrupt(self, host: int, rebuilt: bool) -> SnapshotCorrupted:
        how = "rebuilt from parity" if rebuilt else "kept"
        paths = self.paths
        held = [
            paths[i]
            for i, layout in enumerate(self._layouts)
            if any(p.host == host for p in layout.pieces)
        ]
        listed = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        return SnapshotCorrupted(
            f"erasure-coded snapshot of step {self.step}: the bytes {how} by host {host} "
            f"(device {self.hosts[host]}; pieces of {listed or 'no leaf'}) do not match their "
            "fingerprint (host memory corruption, or corrupt parity). Restore an older "
            f"snapshot (SnapshotRing.restore(at_most={self.step - 1})) or an Orbax checkpoint."
        )

    def verify(self) -> None:
        """Raises :class:`SnapshotCorrupted` naming the host whose bytes changed (lost hosts'
        bytes are rebuilt and checked too), or :class:`SnapshotLost`."""
        self._check(self._rebuild_lost())

    def restore(self):
        """The train state, bit-exact, on the shardings it had when taken.

        Lost hosts' pieces are decoded from the surviving hosts' memory; nothing is read from
        storage.

        Raises:
          SnapshotLost: more hosts lost than ``tolerate``.
          SnapshotCorrupted: a host's bytes (kept or rebuilt) do not match their fingerprint.
        """
        leaves = self._leaves(self._rebuild_lost())
        rebuilt = [rebuild_leaf(r, x) for r, x in zip(self._recipes, leaves, strict=True)]
        return jax.tree.unflatten(self._treedef, rebuilt)
