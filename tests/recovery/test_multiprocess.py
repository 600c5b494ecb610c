"""Two processes on this machine under ``jax.distributed``: the guard's cross-replica check and
an Orbax checkpoint written by both."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from sdcguard.guard import Reason

from tests.helpers import MULTIPROCESS_WORKER

WORKER = MULTIPROCESS_WORKER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_refuse_the_same_corrupted_update_and_restore_a_shared_checkpoint(
    tmp_path,
):
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"  # two replicas per process
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i), str(tmp_path / "ckpt")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert sorted(r["process"] for r in results) == [0, 1]
    assert all(r["devices"] == 4 for r in results)
    expected = [[0, -1, -1]] * 6
    # Refused by both processes, naming replica 3, which lives on process 1.
    expected[3] = [int(Reason.REPLICA_MISMATCH), 3, 1]
    assert [r["seen"] for r in results] == [expected, expected]
    # Both processes hold the same parameters, and the checkpoint they wrote together
    # restores bit-exact on each.
    assert results[0]["params_fingerprint"] == results[1]["params_fingerprint"]
    for r in results:
        assert r["restored"] == r["saved"] and r["meta"] == {"data_index": 6}
