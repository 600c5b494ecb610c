"""Erasure-coded snapshots (REFT): any host's memory lost, the snapshot comes back bit-exact."""

from __future__ import annotations

import builtins
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcguard.recovery import (
    CodedSnapshot,
    ErasureCode,
    HostMemory,
    SnapshotCorrupted,
    SnapshotLost,
    SnapshotRing,
    TrainState,
)

from tests.helpers.multidevice import needs_8, run_on_8_devices


def assert_same_state(restored, original):
    """Structure, dtypes, shardings and every bit of every leaf."""
    assert jax.tree.structure(restored) == jax.tree.structure(original)
    for r, o in zip(jax.tree.leaves(restored), jax.tree.leaves(original), strict=True):
        if not isinstance(o, jax.Array):  # a host-side Python number
            assert type(r) is type(o) and r == o
            continue
        if jax.dtypes.issubdtype(o.dtype, jax.dtypes.prng_key):
            r, o = jax.random.key_data(r), jax.random.key_data(o)
        assert r.dtype == o.dtype and r.shape == o.shape
        assert r.sharding.is_equivalent_to(o.sharding, r.ndim)
        assert np.asarray(r).tobytes() == np.asarray(o).tobytes()


def test_erasure_code_settings_are_checked():
    with pytest.raises(ValueError, match="tolerate must be >= 1"):
        ErasureCode(tolerate=0)


def test_a_state_on_one_device_cannot_be_coded_and_the_snapshot_is_dropped():
    if jax.device_count() >= 8:
        pytest.skip("this process has 8 devices")
    ring = SnapshotRing(keep=1, erasure=ErasureCode())
    ring.take({"w": jnp.ones((4, 4))}, step=3)
    ring.wait()
    assert ring.snapshots() == []  # never restorable
    assert "needs the state on at least 2 devices" in ring.failures[0]
    ring.close()


# --- On 8 CPU devices -------------------------------------------------------------------------


def test_erasure_coding_in_a_subprocess_with_8_cpu_devices():
    """Runs this file's ``on_8_devices`` tests in a process that sees 8 CPU devices."""
    out = run_on_8_devices(__file__)
    assert " passed" in out and "skipped" not in out.splitlines()[-1]


def sharded_state():
    """A train state spread over 8 devices as a sharded job holds it: parameters and optimizer
    moments split along different axes, replicated leaves, a bf16 leaf, a step counter on one
    device, a typed PRNG key, and a host-side Python number."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",))
    rows, cols = NamedSharding(mesh, P("data")), NamedSharding(mesh, P(None, "data"))
    everywhere = NamedSharding(mesh, P())
    k = iter(jax.random.split(jax.random.key(0), 8))
    params = {
        "w": jax.device_put(jax.random.normal(next(k), (64, 24)), rows),
        "u": jax.device_put(jax.random.normal(next(k), (12, 40)), cols),
        "b": jax.device_put(jax.random.normal(next(k), (24,)), everywhere),
        "h": jax.device_put(jax.random.normal(next(k), (16, 8)).astype(jnp.bfloat16), rows),
    }
    opt_state = {
        "mu": jax.tree.map(lambda x: x * 0.5, params),
        "count": jax.device_put(jnp.arange(8, dtype=jnp.int32), rows),
        "lr": 3e-3,
    }
    return TrainState(jnp.int32(40), params, opt_state, jax.random.key(7))


def coded(tolerate: int = 1) -> tuple[TrainState, CodedSnapshot]:
    state = sharded_state()
    ring = SnapshotRing(keep=1, erasure=ErasureCode(tolerate=tolerate))
    ring.take(state, step=40, meta={"data_index": 40})
    ring.wait()
    assert ring.failures == []
    snapshot = ring.latest()
    ring.close()
    assert isinstance(snapshot, CodedSnapshot)
    return state, snapshot


@pytest.fixture
def no_storage(monkeypatch):
    """Any attempt to open a file fails the test: restoring must read host memory only."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"restore read storage: open{args}")

    monkeypatch.setattr(builtins, "open", refuse)


@needs_8
@pytest.mark.parametrize("host", range(8))
def test_losing_any_one_host_restores_bit_exact_on_8_devices(host, no_storage):
    state, snapshot = coded()
    snapshot.lose(host)
    assert snapshot.lost == (host,) and snapshot.memory(host) is None
    assert_same_state(snapshot.restore(), state)


@needs_8
def test_a_stronger_code_survives_any_two_hosts_on_8_devices(no_storage):
    state, snapshot = coded(tolerate=2)
    memory = [snapshot.memory(h) for h in range(8)]
    for pair in itertools.combinations(range(8), 2):
        snapshot._memory[:] = memory  # every host back, then two lost
        snapshot.lose(*pair)
        assert_same_state(snapshot.restore(), state)


@needs_8
def test_memory_is_the_unique_shards_plus_one_seventh_in_parity_on_8_devices():
    state, snapshot = coded()
    data, parity = snapshot.nbytes()
    keys = jax.random.key_data(state.rng)
    unique = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state._replace(rng=keys)))
    assert data == unique  # replicated leaves kept once, by one host
    assert snapshot.k == 7 and parity == 8 * snapshot.chunk
    sizes = [snapshot.memory(h).data.size for h in range(8)]
    assert snapshot.chunk == -(-max(sizes) // 7)
    # 1/7 of the data, up to the hosts' imbalance (whole shards; here 2.3 KB each).
    assert data / 7 <= parity <= 1.1 * data / 7


@needs_8
def test_losing_more_hosts_than_the_code_tolerates_is_refused_on_8_devices():
    _, snapshot = coded()
    snapshot.lose(2, 6)
    with pytest.raises(SnapshotLost, match=r"hosts \[2, 6\].*rebuilds at most 1.*checkpoint"):
        snapshot.restore()
    assert issubclass(SnapshotLost, SnapshotCorrupted)  # a rollback falls back past it


@needs_8
@pytest.mark.parametrize("where", ["parity", "data"])
def test_corrupt_host_memory_is_named_not_restored_on_8_devices(where):
    _, snapshot = coded()
    lost = 4
    if where == "parity":
        # Host 0 holds the parity of stripe 0, whose data hosts include host 4.
        victim = 0
        memory = snapshot.memory(victim)
        bad = memory.parity.copy()
        bad[0, 0] ^= 0x40
        snapshot._memory[victim] = memory._replace(parity=bad)
        expected = "rebuilt from parity by host 4"
    else:
        victim = 5
        memory = snapshot.memory(victim)
        bad = memory.data.copy()
        bad[3] ^= 0x01
        snapshot._memory[victim] = HostMemory(bad, memory.parity)
        expected = "kept by host 5"
    snapshot.lose(lost)
    with pytest.raises(SnapshotCorrupted, match=expected):
        snapshot.restore()


@needs_8
def test_rebuilding_a_lost_host_protects_the_snapshot_again_on_8_devices(no_storage):
    state, snapshot = coded()
    kept = snapshot.memory(3)
    snapshot.lose(3)
    snapshot.rebuild()
    assert snapshot.lost == ()
    assert snapshot.memory(3).data.tobytes() == kept.data.tobytes()
    assert snapshot.memory(3).parity.tobytes() == kept.parity.tobytes()
    snapshot.lose(6)  # a second loss, after the replacement host got its memory back
    assert_same_state(snapshot.restore(), state)


@needs_8
def test_the_ring_restores_a_coded_snapshot_after_a_lost_host_on_8_devices():
    state = sharded_state()
    ring = SnapshotRing(keep=2, erasure=ErasureCode())
    ring.take(state, step=10, meta={"data_index": 10})
    ring.wait()
    ring.latest().lose(1)
    restored, snapshot = ring.restore(at_most=10)
    assert snapshot.step == 10 and snapshot.meta == {"data_index": 10}
    assert_same_state(restored, state)
    ring.close()
