"""A reward for the GRPO e2e run that also kills a rollout engine once, mid-run.

It runs in a Ray task of the run's cluster: at its ``KILL_AT``-th call it
kills the alive rollout engine actor (Ray restarts it: ``max_restarts``),
and leaves a marker file so that it happens once: the path is the prompt
records' ``kill_marker`` field (a field reaches the task; the test's
environment does not reach a shared cluster's workers). The rewards are the
example task's."""

from __future__ import annotations

import os

from ray_fsdp_backend.rl.example_task import letter_share

KILL_AT = 3
"""The step whose rewards kill the engine (one reward task a step)."""


def letter_share_killing_once(prompts, completions, letter, kill_marker, **fields):
    marker = kill_marker[0]
    calls = int(open(marker).read()) + 1 if os.path.exists(marker) else 1
    with open(marker, "w") as f:
        f.write(str(calls))
    if calls == KILL_AT:
        import ray
        from ray.util.state import list_actors

        killed = 0
        for actor in list_actors(filters=[("class_name", "=", "HFRollout")]):
            if actor.state == "ALIVE" and actor.name:
                ray.kill(ray.get_actor(actor.name, namespace=actor.ray_namespace),
                         no_restart=False)  # fmt: skip
                killed += 1
        with open(marker + ".killed", "w") as f:
            f.write(str(killed))
    return letter_share(prompts, completions, letter)
