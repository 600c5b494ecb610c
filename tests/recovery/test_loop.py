"""Snapshots, Orbax checkpoints and the recovering training loop: bit-exact or a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sdcguard.guard import refuse_corrupted
from sdcguard.recovery import (
    CheckpointCorrupted,
    CheckpointTier,
    RecoveryConfig,
    RecoveryError,
    SnapshotCorrupted,
    SnapshotRing,
    TrainState,
    _snapshots as snapshots,
    train_with_recovery,
)

from tests.helpers.multidevice import needs_8, run_on_8_devices


def assert_trees_equal(a, b):
    """Bit-for-bit equality of two pytrees, typed PRNG keys and shardings included."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert type(x) is type(y)
        if isinstance(x, jax.Array):
            assert x.dtype == y.dtype and x.sharding == y.sharding
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


TX = refuse_corrupted(optax.adam(0.05), max_consecutive=3)


def initial_state(seed: int = 0) -> TrainState:
    params = {"w": jax.random.normal(jax.random.key(seed), (4, 2)), "b": jnp.zeros((2,))}
    return TrainState(jnp.zeros((), jnp.int32), params, TX.init(params), jax.random.key(seed))


def rich_state():
    """A train state with every kind of leaf a snapshot must carry."""
    state = initial_state()
    extras = {"bf16": jnp.arange(6, dtype=jnp.bfloat16), "count": 7, "mask": np.array([True])}
    return state._replace(params={**state.params, **extras})


# --- Snapshots ---------------------------------------------------------------------------------


def test_snapshot_round_trip_is_bit_exact():
    state = rich_state()
    ring = SnapshotRing(keep=2)
    ring.take(state, step=0, meta={"data_index": 0})
    ring.wait()
    restored, snap = ring.restore()
    assert (snap.step, snap.meta) == (0, {"data_index": 0})
    assert_trees_equal(restored, state)
    ring.close()


def test_ring_keeps_the_last_k_and_restores_at_most_a_step():
    ring = SnapshotRing(keep=2)
    states = {s: initial_state(seed=s) for s in (0, 10, 20, 30)}
    for step, state in states.items():
        ring.take(state, step=step)
    ring.wait()
    assert [s.step for s in ring.snapshots()] == [20, 30]
    restored, snap = ring.restore(at_most=25)
    assert snap.step == 20
    assert_trees_equal(restored, states[20])
    with pytest.raises(RecoveryError, match="no complete in-memory snapshot at or before step 5"):
        ring.restore(at_most=5)
    ring.drop_newer_than(20)
    assert [s.step for s in ring.snapshots()] == [20]


def in_snapshot_worker() -> bool:
    return threading.current_thread().name.startswith("sdcguard-snap")


def test_a_snapshot_still_copying_is_never_restored(monkeypatch):
    release = threading.Event()
    fingerprint = snapshots.host_fingerprint

    def slow_fingerprint(x):
        if in_snapshot_worker():
            release.wait(timeout=30)
        return fingerprint(x)

    ring = SnapshotRing(keep=3)
    first, second = initial_state(1), initial_state(2)
    ring.take(first, step=1)
    ring.wait()
    monkeypatch.setattr(snapshots, "host_fingerprint", slow_fingerprint)
    ring.take(second, step=2)  # returns while its copy is blocked half-way

    restored, snap = ring.restore()
    assert snap.step == 1
    assert_trees_equal(restored, first)
    release.set()
    ring.wait()
    assert [s.step for s in ring.snapshots()] == [1, 2]


def test_a_failed_snapshot_is_dropped_and_the_previous_one_stays(monkeypatch):
    fingerprint = snapshots.host_fingerprint

    def failing(x):
        if in_snapshot_worker():
            raise MemoryError("host out of memory")
        return fingerprint(x)

    ring = SnapshotRing(keep=3)
    ring.take(initial_state(1), step=1)
    ring.wait()
    monkeypatch.setattr(snapshots, "host_fingerprint", failing)
    ring.take(initial_state(2), step=2)
    ring.wait()
    assert [s.step for s in ring.snapshots()] == [1]
    assert "snapshot of step 2 failed" in ring.failures[0]


def test_a_tampered_snapshot_refuses_to_restore():
    ring = SnapshotRing()
    ring.take(initial_state(), step=40)
    ring.wait()
    snap = ring.latest()
    leaf = snap.leaves[snap.paths.index(".params['b']")]
    with pytest.raises(ValueError, match="read-only"):
        leaf[0] += 1  # snapshots are read-only...
    leaf.setflags(write=True)  # ...so this is deliberate tampering
    leaf.reshape(-1)[0] += 1
    with pytest.raises(SnapshotCorrupted, match=r"step 40: leaf \.params\['b'\].*Restore an older"):
        ring.restore()


@pytest.mark.parametrize("kwargs", [{"keep": 0}, {"max_in_flight": 0}])
def test_bad_ring_settings_are_rejected(kwargs):
    with pytest.raises(ValueError, match=r"keep|max_in_flight"):
        SnapshotRing(**kwargs)


# --- Orbax checkpoints ------------------------------------------------------------------------


def test_checkpoint_round_trip_is_bit_exact(tmp_path):
    state = rich_state()
    tier = CheckpointTier(tmp_path, keep=2)
    tier.save(100, state, meta={"data_index": 100})
    tier.wait()
    tier.close()
    reopened = CheckpointTier(tmp_path)
    assert reopened.steps() == [100]
    restored, meta = reopened.restore(like=rich_state())
    assert meta == {"data_index": 100}
    assert_trees_equal(restored, state)


def test_leftover_temp_dir_of_a_crashed_save_is_ignored_and_cleaned(tmp_path):
    state = initial_state()
    tier = CheckpointTier(tmp_path)
    tier.save(1, state)
    tier.close()
    partial = tmp_path / "2.orbax-checkpoint-tmp"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "_METADATA").write_text('{"tree_metadata": {"trunc')
    reopened = CheckpointTier(tmp_path)
    assert reopened.steps() == [1]
    restored, _ = reopened.restore(like=initial_state(seed=9))
    assert_trees_equal(restored, state)
    reopened.save(3, state)  # Orbax finishes removing leftovers before its next save
    reopened.wait()
    assert reopened.steps() == [1, 3] and not partial.exists()


CRASHING_SAVE = textwrap.dedent(
    """
    import os, sys
    import jax.numpy as jnp
    from sdcguard.recovery import CheckpointTier
    tier = CheckpointTier(sys.argv[1])
    tier.save(1, {"w": jnp.arange(8.0)})
    tier.wait()
    tier.save(2, {"w": jnp.arange(4_000_000.0)})  # returns while the write goes on
    os._exit(3)  # the process dies mid-save: no finalisation, no cleanup
    """
)


def test_a_process_killed_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", CRASHING_SAVE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 3, result.stderr[-2000:]
    tier = CheckpointTier(tmp_path)
    assert 1 in tier.steps()
    restored, _ = tier.restore(like={"w": jnp.zeros(8)}, step=1)
    assert_trees_equal(restored, {"w": jnp.arange(8.0)})
    if 2 in tier.steps():  # the write may have won the race; then it must be whole
        big, _ = tier.restore(like={"w": jnp.zeros(4_000_000)}, step=2)
        assert_trees_equal(big, {"w": jnp.arange(4_000_000.0)})


def tamper_integrity(path: Path, edit):
    record_file = path / "integrity" / "metadata"
    record_file.write_text(edit(record_file.read_text()))


def flip_fingerprint(text: str) -> str:
    record = json.loads(text)
    record["leaves"][1]["fingerprint"][0] ^= 1
    return json.dumps(record)


def flip_data_bytes(path: Path):
    data = max(
        (p for p in (path / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    blob = bytearray(data.read_bytes())
    for i in range(len(blob) // 2, len(blob) // 2 + 8):
        blob[i] ^= 0xFF
    data.write_bytes(bytes(blob))


TAMPERING = {
    "truncated_record": (lambda p: tamper_integrity(p, lambda t: t[: len(t) // 2]), "integrity"),
    "edited_fingerprint": (
        lambda p: tamper_integrity(p, flip_fingerprint),
        r"leaf .*\['b'\] does not match its fingerprint",
    ),
    "wrong_version": (
        lambda p: tamper_integrity(p, lambda t: t.replace('"version": 2', '"version": 99')),
        "format version 99",
    ),
    "flipped_data": (flip_data_bytes, "truncated, tampered with"),
}


@pytest.mark.parametrize("case", sorted(TAMPERING))
def test_a_tampered_checkpoint_is_refused_with_a_clear_error(tmp_path, case):
    tamper, message = TAMPERING[case]
    state = TrainState(
        jnp.zeros((), jnp.int32), {"w": jnp.arange(4096.0), "b": jnp.ones(3)}, (), jax.random.key(0)
    )
    tier = CheckpointTier(tmp_path)
    tier.save(5, state)
    tier.close()
    tamper(tmp_path / "5")
    with pytest.raises(CheckpointCorrupted, match=message) as error:
        CheckpointTier(tmp_path).restore(like=state)
    assert "delete" in str(error.value) and "restore another step" in str(error.value)


def data_files(item: Path) -> list[Path]:
    return sorted(
        (p for p in item.rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: p.stat().st_size,
    )


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_data_file_names_the_leaf_not_a_storage_dump(tmp_path, damage):
    state = {"params": {"w": jnp.arange(40_000.0).reshape(200, 200), "b": jnp.ones(3)}}
    tier = CheckpointTier(tmp_path)
    tier.save(5, state)
    tier.wait()
    biggest = data_files(tmp_path / "5" / "state")[-1]
    if damage == "truncated":
        with biggest.open("r+b") as f:
            f.truncate(100)
    else:
        biggest.unlink()
    with pytest.raises(CheckpointCorrupted) as error:
        tier.restore(like=state)
    message = str(error.value)
    assert "leaf ['params']['w']" in message and "missing or truncated" in message
    assert "TensorStore" not in message and len(message) < 600


def test_checkpoints_are_plain_orbax_of_the_users_own_tree(tmp_path):
    """A plain Orbax user restores a CheckpointTier checkpoint into their tree, as usual."""
    import orbax.checkpoint as ocp

    state = rich_state()
    tier = CheckpointTier(tmp_path)
    tier.save(3, state, meta={"data_index": 3})
    tier.close()
    abstract = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        state,
    )
    manager = ocp.CheckpointManager(tmp_path)
    restored = manager.restore(
        3, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
    ).state
    manager.close()
    assert_trees_equal(restored, state)
    record = json.loads((tmp_path / "3" / "integrity" / "metadata").read_text())
    assert [e["path"] for e in record["leaves"]][:2] == [".step", ".params['b']"]
    assert len(record["fingerprint"]) == 2


def test_a_plain_orbax_checkpoint_restores_unverified_with_a_warning(tmp_path):
    import orbax.checkpoint as ocp

    state = rich_state()
    manager = ocp.CheckpointManager(tmp_path)
    manager.save(7, args=ocp.args.StandardSave(state))  # Orbax's own default item
    manager.wait_until_finished()
    manager.close()
    with pytest.warns(UserWarning, match="no sdcguard integrity record.*UNVERIFIED"):
        restored, meta = CheckpointTier(tmp_path).restore(like=rich_state())
    assert meta == {}
    assert_trees_equal(restored, state)


def test_whole_tree_fingerprint_in_the_record_matches_tree_fingerprint(tmp_path):
    from sdcguard.guard import tree_fingerprint

    state = initial_state()
    state = state._replace(params={**state.params, "bf16": jnp.arange(6, dtype=jnp.bfloat16)})
    tier = CheckpointTier(tmp_path)
    tier.save(1, state)
    tier.close()
    record = json.loads((tmp_path / "1" / "integrity" / "metadata").read_text())
    leaves = jax.tree.leaves(state)
    assert record["fingerprint"] == [int(v) for v in tree_fingerprint(leaves)]


def test_restoring_into_a_different_structure_names_the_mismatch(tmp_path):
    tier = CheckpointTier(tmp_path)
    tier.save(3, {"w": jnp.ones((4, 2))})
    tier.wait()
    with pytest.raises(CheckpointCorrupted, match=r"does not fit.*\(4, 2\).*\(4, 3\)"):
        tier.restore(like={"w": jnp.ones((4, 3))})
    with pytest.raises(RecoveryError, match="no complete checkpoint of step 7"):
        tier.restore(like={"w": jnp.ones((4, 2))}, step=7)


# --- The recovering training loop --------------------------------------------------------------

TRUE_W = np.arange(8, dtype=np.float32).reshape(4, 2) / 4


def batch(i: int, poisoned: bool = False):
    x = np.random.default_rng(i).normal(size=(16, 4)).astype(np.float32)
    return x, x @ TRUE_W, np.float32(np.nan if poisoned else 1.0)


@jax.jit
def train_step(state: TrainState, data) -> TrainState:
    x, y, poison = data

    def loss_fn(params):
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    grads = jax.tree.map(lambda g: g * poison, grads)  # the "fault": NaN gradients
    updates, opt_state = TX.update(grads, state.opt_state, state.params, loss=loss)
    params = optax.apply_updates(state.params, updates)
    return TrainState(state.step + 1, params, opt_state, state.rng)


def reference(indices) -> TrainState:
    state = initial_state()
    for i in indices:
        state = train_step(state, batch(i))
    return state


def test_persistent_bad_batches_are_rolled_back_and_skipped():
    bad = set(range(20, 26))
    report = train_with_recovery(
        train_step,
        initial_state(),
        lambda i: batch(i, poisoned=i in bad),
        num_batches=60,
        config=RecoveryConfig(snapshot_every=10, keep_snapshots=3, on_rollback="skip"),
    )
    assert report.skipped == sorted(bad)
    assert [r.source for r in report.rollbacks] == ["snapshot", "snapshot"]
    assert report.rollbacks[0].reasons == ("nonfinite",)
    # The second incident followed the first without an accepted step: it went further back.
    assert report.rollbacks[1].to_step < report.rollbacks[0].to_step
    assert {d for _, d, _ in report.refused} == bad
    # Bit for bit the run that never saw the bad batches, guard counters included.
    assert_trees_equal(report.state, reference(i for i in range(60) if i not in bad))


def test_a_transient_fault_is_replayed_to_the_clean_result():
    pending_faults = {30, 31, 32}

    def flaky_batch(i):
        poisoned = i in pending_faults
        pending_faults.discard(i)  # the hardware glitch does not repeat
        return batch(i, poisoned)

    report = train_with_recovery(
        train_step,
        initial_state(),
        flaky_batch,
        num_batches=50,
        config=RecoveryConfig(snapshot_every=5, on_rollback="replay"),
    )
    assert len(report.rollbacks) == 1 and report.skipped == []
    assert report.rollbacks[0].to_step == 30
    assert_trees_equal(report.state, reference(range(50)))
    # Three refused, one speculative step discarded, three replayed.
    assert report.steps_run == 50 + 3 + 1


def test_isolated_refusals_need_no_rollback():
    report = train_with_recovery(
        train_step,
        initial_state(),
        lambda i: batch(i, poisoned=i in (7, 19)),
        num_batches=30,
        config=RecoveryConfig(snapshot_every=10),
    )
    assert report.rollbacks == [] and report.steps_run == 30
    assert [(s, d) for s, d, _ in report.refused] == [(7, 7), (19, 19)]
    expected = reference(i for i in range(30) if i not in (7, 19))
    assert_trees_equal(report.state.params, expected.params)


def test_rollback_restores_from_orbax_when_it_is_the_newest_good_state(tmp_path):
    tier = CheckpointTier(tmp_path, keep=2)
    report = train_with_recovery(
        train_step,
        initial_state(),
        lambda i: batch(i, poisoned=i in (24, 25, 26)),
        num_batches=40,
        config=RecoveryConfig(snapshot_every=None, checkpoint_every=10, on_rollback="skip"),
        checkpoints=tier,
    )
    assert [(r.source, r.to_step) for r in report.rollbacks] == [("checkpoint", 20)]
    assert tier.steps() == [20, 30]  # 37 steps: the three bad batches were skipped
    assert_trees_equal(report.state, reference(i for i in range(40) if i not in (24, 25, 26)))


def test_a_corrupt_newest_snapshot_is_reported_and_an_older_one_restored():
    ring = SnapshotRing(keep=3)
    bad = {24, 25, 26}

    def batch_at(i):
        if i == 24:  # host memory corrupts the newest snapshot (step 20) before it is needed
            ring.wait()
            leaf = ring.latest().leaves[1]
            leaf.setflags(write=True)
            leaf.reshape(-1)[0] += 1
        return batch(i, poisoned=i in bad)

    report = train_with_recovery(
        train_step,
        initial_state(),
        batch_at,
        num_batches=40,
        config=RecoveryConfig(snapshot_every=10, keep_snapshots=3, on_rollback="skip"),
        snapshots=ring,
    )
    assert [(r.source, r.to_step) for r in report.rollbacks] == [("snapshot", 10)]
    assert len(report.corrupt) == 1 and report.corrupt[0].startswith("snapshot of step 20: ")
    assert_trees_equal(report.state, reference(i for i in range(40) if i not in bad))


def test_a_corrupt_newest_checkpoint_is_reported_and_an_older_one_restored(tmp_path):
    tier = CheckpointTier(tmp_path, keep=3)
    bad = {24, 25, 26}

    def batch_at(i):
        if i == 24:
            tier.wait()
            flip_data_bytes(tmp_path / "20")
        return batch(i, poisoned=i in bad)

    report = train_with_recovery(
        train_step,
        initial_state(),
        batch_at,
        num_batches=40,
        config=RecoveryConfig(snapshot_every=None, checkpoint_every=10, on_rollback="skip"),
        checkpoints=tier,
    )
    assert [(r.source, r.to_step) for r in report.rollbacks] == [("checkpoint", 10)]
    assert report.corrupt[0].startswith("checkpoint of step 20: ")
    assert_trees_equal(report.state, reference(i for i in range(40) if i not in bad))


def test_no_intact_stored_state_raises_naming_each_one_tried(tmp_path):
    ring = SnapshotRing(keep=1)
    tier = CheckpointTier(tmp_path)

    def batch_at(i):
        if i == 14:
            ring.wait()
            tier.wait()
            flip_data_bytes(tmp_path / "10")
            leaf = ring.latest().leaves[1]
            leaf.setflags(write=True)
            leaf.reshape(-1)[0] += 1
        return batch(i, poisoned=i >= 14)

    with pytest.raises(RecoveryError, match="no stored state at or before step 14 is intact") as e:
        train_with_recovery(
            train_step,
            initial_state(),
            batch_at,
            num_batches=30,
            config=RecoveryConfig(snapshot_every=None, checkpoint_every=10),
            snapshots=ring,
            checkpoints=tier,
        )
    tried = str(e.value).split("newest first:")[1]
    assert tried.index("checkpoint of step 10:") < tried.index("snapshot of step 0:")


def test_refusals_that_never_stop_end_in_a_clear_error():
    with pytest.raises(RecoveryError, match=r"still refused after 2 rollbacks.*sdcguard compare"):
        train_with_recovery(
            train_step,
            initial_state(),
            lambda i: batch(i, poisoned=i >= 12),
            num_batches=40,
            config=RecoveryConfig(snapshot_every=4, on_rollback="replay", max_rollbacks=2),
        )


def test_an_error_ends_the_run_with_its_checkpoints_on_disk_and_the_report(tmp_path):
    tier = CheckpointTier(tmp_path, keep=5)
    saved = tier.save
    # Each save takes long enough that the one at step 12 is still in flight at the error.
    tier.save = lambda *args, **kwargs: (threading.Event().wait(0.2), saved(*args, **kwargs))
    with pytest.raises(RecoveryError, match="still refused after 2 rollbacks") as e:
        train_with_recovery(
            train_step,
            initial_state(),
            lambda i: batch(i, poisoned=i >= 12),
            num_batches=40,
            config=RecoveryConfig(
                snapshot_every=4, checkpoint_every=4, on_rollback="replay", max_rollbacks=2
            ),
            checkpoints=tier,
        )
    assert sorted(os.listdir(tmp_path)) == ["12", "4", "8"]  # no Orbax temporary directory
    restored, meta = CheckpointTier(tmp_path).restore(like=initial_state(), step=12)
    assert meta == {"data_index": 12}
    assert_trees_equal(restored.params, reference(range(12)).params)
    report = e.value.report
    assert [d for _, d, _ in report.refused][:3] == [12, 13, 14] and len(report.rollbacks) == 2


def test_an_error_in_the_data_ends_the_run_with_its_checkpoints_on_disk(tmp_path):
    def batch_at(i):
        if i == 13:
            raise OSError("the data server went away")
        return batch(i)

    with pytest.raises(OSError, match="the data server went away"):
        train_with_recovery(
            train_step,
            initial_state(),
            batch_at,
            num_batches=40,
            config=RecoveryConfig(snapshot_every=None, checkpoint_every=4),
            checkpoints=CheckpointTier(tmp_path),
        )
    assert sorted(os.listdir(tmp_path)) == ["12", "4", "8"]


@pytest.mark.parametrize("start", [0, 4], ids=["new_run", "behind_the_newest"])
def test_a_checkpoint_directory_holding_later_steps_is_refused_before_step_0(tmp_path, start):
    other = CheckpointTier(tmp_path)
    other.save(100, initial_state(seed=1), meta={"data_index": 100})
    other.wait()
    calls = []

    def step(state, b):
        calls.append(b)
        return train_step(state, b)

    state = reference(range(start))
    with pytest.raises(ValueError, match=r"already holds steps \[100\], after this run's start"):
        train_with_recovery(
            step,
            state,
            batch,
            num_batches=10,
            config=RecoveryConfig(checkpoint_every=2),
            checkpoints=CheckpointTier(tmp_path),
            start_index=start,
        )
    assert calls == [] and sorted(os.listdir(tmp_path)) == ["100"]  # the other run's, kept


def test_a_checkpoint_orbax_does_not_write_is_an_error(tmp_path):
    tier = CheckpointTier(tmp_path)
    tier.save(8, initial_state())
    with pytest.raises(RecoveryError, match=r"checkpoint step 4 was not written.*holds steps"):
        tier.save(4, initial_state())


def test_a_step_that_donates_its_state_is_refused_at_the_first_step():
    donating = jax.jit(train_step, donate_argnums=0)
    with pytest.raises(ValueError, match="step_fn donated its input state"):
        train_with_recovery(donating, jax.tree.map(jnp.copy, initial_state()), batch, num_batches=5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"snapshot_every": 0}, "snapshot_every must be >= 1"),
        ({"checkpoint_every": -5}, "checkpoint_every must be >= 1"),
        ({"keep_snapshots": 0}, "keep_snapshots must be >= 1"),
        ({"on_rollback": "ignore"}, "on_rollback must be 'skip' or 'replay'"),
        ({"max_rollbacks": 0}, "max_rollbacks must be >= 1"),
    ],
)
def test_bad_recovery_config_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RecoveryConfig(**kwargs)


def test_checkpoint_interval_without_a_tier_is_rejected():
    with pytest.raises(ValueError, match="no checkpoints= was given"):
        train_with_recovery(
            train_step,
            initial_state(),
            batch,
            num_batches=1,
            config=RecoveryConfig(checkpoint_every=10),
        )


# --- Sharded round trips on 8 CPU devices ----------------------------------------------------


def test_multidevice_checks_in_a_subprocess_with_8_cpu_devices():
    """Runs this file's ``on_8_devices`` tests in a process that sees 8 CPU devices."""
    out = run_on_8_devices(__file__)
    assert "2 passed" in out


def sharded_state():
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "model")))
    b = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P()))
    key = jax.device_put(jax.random.key(3), NamedSharding(mesh, P()))
    params = {"w": w, "b": b}
    return TrainState(jnp.zeros((), jnp.int32), params, TX.init(params), key)


@needs_8
def test_snapshot_restores_onto_the_original_shardings_on_8_devices():
    state = sharded_state()
    ring = SnapshotRing()
    ring.take(state, step=0)
    ring.wait()
    restored, _ = ring.restore()
    assert restored.params["w"].sharding.spec == jax.sharding.PartitionSpec("data", "model")
    assert_trees_equal(restored, state)


@needs_8
def test_checkpoint_restores_onto_the_original_shardings_on_8_devices(tmp_path):
    state = sharded_state()
    tier = CheckpointTier(tmp_path)
    tier.save(1, state)
    tier.wait()
    restored, _ = tier.restore(like=sharded_state())
    assert len(restored.params["w"].sharding.device_set) == 8
    assert_trees_equal(restored, state)
