"""One process of the 2-process test (tests/test_multiprocess.py); run as a script.

``python multiprocess_worker.py PORT PROCESS_ID CHECKPOINT_DIR`` joins a localhost
``jax.distributed`` job of two CPU processes (two devices each: four replicas, so that a
majority can name the odd one), trains the reference GPT (tiny) data-parallel under the update
guard's cross-replica check with one process's gradient corrupted at step 3 (on one of its two
replicas), saves an Orbax checkpoint from both processes and restores it, and prints one JSON
line with what it saw.
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, process_id, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from sdcguard.guard import refuse_corrupted, tree_fingerprint  # noqa: E402
from sdcguard.models import GPT, ByteBatches, GPTConfig, init_params, lm_loss  # noqa: E402
from sdcguard.recovery import CheckpointTier  # noqa: E402

BAD_STEP, BAD_REPLICA = 3, 3

mesh = jax.make_mesh((jax.device_count(),), ("data",))
replicated = NamedSharding(mesh, P())
config = GPTConfig(d_model=32, num_layers=1, num_heads=2, seq_len=32)
model = GPT(config)
# Replicas compare all-reduced gradients bit for bit; the corruption below makes them differ
# on purpose, so shard_map's type check (which would call them varying) is off.
tx = refuse_corrupted(optax.adam(3e-3), axis_name="data", gradients="replicated")


def step(params, opt_state, tokens, step_index):
    def loss_fn(p):
        return lm_loss(model.apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])

    loss, grads = jax.value_and_grad(loss_fn)(params)
    grads, loss = jax.lax.pmean((grads, loss), "data")
    # The fault: replica 3's copy of the all-reduced gradient, one element, at one step.
    hit = (jax.lax.axis_index("data") == BAD_REPLICA) & (step_index == BAD_STEP)
    leaves, treedef = jax.tree.flatten(grads)
    leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].add(jnp.where(hit, 1e-3, 0.0))
    grads = treedef.unflatten(leaves)
    updates, opt_state = tx.update(grads, opt_state, params, loss=loss)
    return optax.apply_updates(params, updates), opt_state


sharded_step = jax.jit(
    jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P()),
        out_specs=(P(), P()),
        check_vma=False,
    )
)


def global_batch(i: int):
    local = ByteBatches(
        batch_size=2 * jax.local_device_count(), seq_len=config.seq_len, seed=process_id
    ).batch(i)
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)


params = jax.device_put(init_params(model, 0), replicated)
opt_state = jax.device_put(tx.init(params), replicated)
seen = []
for i in range(6):
    params, opt_state = sharded_step(params, opt_state, global_batch(i), jnp.int32(i))
    local = lambda x: int(np.asarray(x.addressable_data(0)))
    odd = local(opt_state.odd_replica)
    owner = mesh.devices.reshape(-1)[odd].process_index if odd >= 0 else -1
    seen.append([local(opt_state.reason), odd, owner])

state = {"params": params, "opt_state": opt_state}
tier = CheckpointTier(directory)
tier.save(6, state, meta={"data_index": 6})
tier.wait()
restored, meta = tier.restore(like=state)
tier.close()
fingerprint = lambda tree: np.asarray(
    tree_fingerprint([x.addressable_data(0) for x in jax.tree.leaves(tree)])
).tolist()
print(
    json.dumps(
        {
            "process": jax.process_index(),
            "devices": jax.device_count(),
            "seen": seen,
            "params_fingerprint": fingerprint(params),
            "saved": fingerprint(state),
            "restored": fingerprint(restored),
            "meta": meta,
        }
    ),
    flush=True,
)
jax.distributed.shutdown()
