"""Start (or join) a Ray cluster whose workers know which cluster is theirs.

Ray Train 2.60's ``PlacementGroupCleaner`` (a detached actor the controller
starts for every run) asks the State API every second whether the controller
is still alive. It builds that client with no address, so Ray looks for a
cluster the way a bare ``ray.init()`` does: ``RAY_ADDRESS``, else the host's
``gcs_server`` processes and the newest ``ray_current_cluster`` file. With a
second cluster on the same host (two pytest workers, a user's notebook
beside ``ray-fsdp train``) that search picks another cluster or none: the
cleaner's thread dies with "Found multiple active Ray instances", printing
a traceback on the run's console, or it asks the other cluster about this
run's controller, hears "no such actor" and removes the run's placement
group under its workers.

:func:`pinned_address_env` fixes it at the source: a ``worker_process_setup_hook``
that sets ``RAY_ADDRESS`` in every worker process to the GCS address that
worker is connected to (Ray reads it before any search). A job-level
runtime environment reaches every actor the job starts, the controller's
cleaner among them. Ray has no switch for this and the cleaner takes no
address, hence these few lines. ``ray-fsdp train`` starts its local cluster
with it; your own driver on a shared host passes
``ray.init(..., runtime_env=pinned_address_env())``, or calls :func:`init_ray`.

The hook travels by value (cloudpickle, registered for this module only): a
worker runs it before it puts the driver's ``sys.path`` on its own, so a hook
named by module path would kill every worker of a run started from a source
checkout that is not installed.
"""

from __future__ import annotations

import os
import sys


def pin_ray_address() -> None:
    """Set this Ray worker's ``RAY_ADDRESS`` to the cluster it is connected to
    (runs in each worker process as its ``worker_process_setup_hook``)."""
    import ray

    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


def pinned_address_env() -> dict:
    """A job's runtime environment whose workers each pin ``RAY_ADDRESS`` to
    their own cluster (:func:`pin_ray_address`)."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return {"worker_process_setup_hook": pin_ray_address}


#: Set by ``ray job submit`` in its entrypoint's environment: the job's runtime env.
SUBMITTED_JOB = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def init_ray(address: str | None = "local", *, runtime_env: dict | None = None, **kwargs):
    """``ray.init(address, **kwargs)``: start (``"local"``) or join (``None``:
    ``RAY_ADDRESS``) a cluster whose workers know it is theirs (``runtime_env``
    plus :func:`pinned_address_env`).

    Not inside a ``ray job submit`` job: that job's runtime environment is the
    user's (Ray merges a driver's into it and refuses a second setup hook), and
    the host it runs on holds that one cluster."""
    import ray

    pin = {} if SUBMITTED_JOB in os.environ else pinned_address_env()
    return ray.init(address=address, runtime_env={**(runtime_env or {}), **pin}, **kwargs)
