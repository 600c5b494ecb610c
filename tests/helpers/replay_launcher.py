"""A stand-in for ``ssh {node}`` in the replay tests: ``python replay_launcher.py NODE CMD...``.

Like a real launcher it prints a login banner on stdout (100 KB: more than a pipe holds)
before running the command. Nodes listed in ``SDCGUARD_TEST_CORRUPT_NODES`` (comma list) run
with ``corrupt_site/`` first on ``PYTHONPATH``: its ``sitecustomize`` patches ``jnp.tanh`` in
that process, so one number changes silently, with no sdcguard fault plan involved.
"""

import os
import sys

node, command = sys.argv[1], sys.argv[2:]
sys.stdout.write(f"Welcome to {node}!\n" + "Last login: never, from nowhere\n" * 3200)
sys.stdout.flush()
env = dict(os.environ)
if node in os.environ.get("SDCGUARD_TEST_CORRUPT_NODES", "").split(","):
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corrupt_site")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
os.execvpe(command[0], command, env)
