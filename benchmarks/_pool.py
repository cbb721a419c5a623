"""One spawned group of ranks that runs job after job (the ``--quick`` run).

``RankPool(world)`` spawns ``world`` gloo ranks once, through the test
harness's entry (:mod:`tests.dist.harness`: environment, one intra-op
thread, the process group, faulthandler, tracebacks on failure);
``pool.run_ranks(fn, world, *args)`` then runs ``fn(rank, world, *args)`` on
them and returns rank 0's result, as ``harness.run_ranks`` does. Spawning the
ranks and importing torch, transformers and the package (10-20 s a job on 2
busy cores) is paid once, not once per comparison. A job at another world
size goes to ``harness.run_ranks`` (its own spawn).

What a job leaves in its ranks (imports, compiled code, allocator pools) the
next one finds: timings and memory peaks of a pooled run are smoke numbers,
not measurements (the full run spawns a job per comparison and per side).
Every job starts from ``torch.manual_seed(0)``, as a fresh spawn does.
"""

from __future__ import annotations

import os
import queue
import tempfile

import torch
import torch.multiprocessing as mp

from tests.dist import harness

_POLL_S = 1.0


def _serve(rank: int, world: int, jobs, results) -> None:
    """Each rank: run jobs from its queue until ``None``; rank 0 sends results."""
    while (job := jobs[rank].get()) is not None:
        fn, args = job
        torch.manual_seed(0)
        out = fn(rank, world, *args)
        if rank == 0:
            results.put(out)


class RankPool:
    """``world`` ranks spawned once; a context manager that stops them on exit."""

    def __init__(self, world: int, timeout_s: float = 300):
        self.world = world
        ctx = mp.get_context("spawn")
        self._jobs = [ctx.SimpleQueue() for _ in range(world)]
        self._results = ctx.Queue()
        self._dir = tempfile.TemporaryDirectory()
        args = (world, harness.free_port(), self._dir.name, _serve,
                (self._jobs, self._results), "gloo", timeout_s, dict(os.environ))  # fmt: skip
        self._context = mp.start_processes(
            harness._entry, args=args, nprocs=world, join=False, start_method="spawn"
        )

    def run_ranks(self, fn, world: int, *args):
        """``harness.run_ranks(fn, world, *args)``, on the pool's ranks at its size."""
        if world != self.world:
            return harness.run_ranks(fn, world, *args)
        for jobs in self._jobs:
            jobs.put((fn, args))
        while True:
            try:
                return self._results.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_alive()

    def _check_alive(self) -> None:
        processes = self._context.processes
        if all(p.exitcode is None for p in processes):
            return
        for p in processes:
            if p.is_alive():
                p.terminate()
        for p in processes:
            p.join()
        failure = RuntimeError("a pooled rank exited during a job")
        raise AssertionError(harness._fates(failure, processes, self._dir.name))

    def close(self) -> None:
        """Stop the ranks (each ends with the harness's ``os._exit(0)``)."""
        try:
            if all(p.exitcode is None for p in self._context.processes):
                for jobs in self._jobs:
                    jobs.put(None)
                while not self._context.join():
                    pass
        finally:
            for p in self._context.processes:
                if p.is_alive():
                    p.terminate()
            for q in (*self._jobs, self._results):
                q.close()
            self._dir.cleanup()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
