"""Run a function on N gloo ranks with torch.multiprocessing, without Ray.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, each of
which initialises a gloo process group on a free loopback port and calls
``fn(rank, world_size, *args)``. What rank 0 returns comes back to the caller
(pickled through a file). A failure on any rank fails the call with every
rank's fate: its exit code or signal, its Python traceback when it raised, and
the native stacks ``faulthandler`` wrote when it crashed (a segfault, an
abort) or hung past its timeout.

The ranks fork from one forkserver per test process, which imports torch, Ray,
transformers, peft and torchao once (those the test process has imported): a
rank starts in a fraction of a second instead of paying 3-10 s of imports,
most of a short gloo test's wall on 2 cores. Each rank still starts from a
process that has run no op, and takes the caller's environment and working
directory as a spawned one would. The server runs one thread (``SERVER_ENV``):
an earlier try, whose server carried idle BLAS and jemalloc threads, once lost
a rank without a traceback in the whole layer.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = (
    "pytest",
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "pyarrow",
    "ray",
    "ray_fsdp_backend.runtime.worker",
    "transformers",
    "transformers.modeling_utils",
    "peft",
    "torchao",
)
"""What the forkserver imports before it forks a rank: of these, those whose
package the test process has imported (a module of tests that use no peft
pays no peft import)."""


SERVER_ENV = {"OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}
"""The forkserver's own environment: its imports start no native thread
(numpy's and scipy's OpenBLAS servers, pyarrow's jemalloc background thread),
so no rank forks from a process whose other threads held a lock. The ranks
take the caller's environment back (:func:`_caller_environment`)."""


def _start_method() -> str:
    """``"forkserver"``, started on first use (once per test process, with
    :data:`PRELOAD`'s imports and :data:`SERVER_ENV`); it keeps its imports."""
    from multiprocessing import forkserver

    mp.set_forkserver_preload([m for m in PRELOAD if m.split(".")[0] in sys.modules])
    saved = {key: os.environ.get(key) for key in SERVER_ENV}
    os.environ.update(SERVER_ENV)
    try:
        forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    return "forkserver"


def _caller_environment(env: Mapping[str, str]) -> None:
    """The caller's ``os.environ`` (the forkserver holds the one it started
    with); ``tempfile`` reads ``TMPDIR`` again."""
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None


def _entry(rank, world_size, port, out_dir, fn, args, backend, timeout_s, env):
    _caller_environment(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # One intra-op thread per rank (as benchmarks.run): the ranks of a spawn
    # and the other test worker share 2 cores, and a second OpenMP thread
    # spinning at every barrier of these tiny ops cost most of their CPU.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # A rank that dies natively (SIGSEGV, SIGABRT) leaves no Python
    # traceback: faulthandler writes every thread's stack to a file the
    # failure message includes. The file stays open until the process ends.
    native = open(os.path.join(out_dir, f"native{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.enable(file=native, all_threads=True)
    # A rank the harness terminates (another rank failed) shows where it was.
    faulthandler.register(signal.SIGTERM, file=native, all_threads=True, chain=True)
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    try:
        result = _profiled(fn, rank, world_size, args)
        if rank == 0:
            with open(os.path.join(out_dir, "result.pkl"), "wb") as f:
                pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # Skip the interpreter's teardown: after a gloo collective and a bfloat16
    # CPU matmul (DMuon's Newton-Schulz), torch 2.13 aborts at exit in C++
    # static destruction ("terminate called without an active exception", in
    # about 40% of runs), after all the work is done and reported.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _profiled(fn, rank, world_size, args):
    """``fn(rank, world_size, *args)``; under ``RANKS_PROFILE=DIR`` profiled
    with cProfile into ``DIR/<fn>.rank<N>.prof`` (``python -m pstats``)."""
    folder = os.environ.get("RANKS_PROFILE")
    if not folder:
        return fn(rank, world_size, *args)
    import cProfile

    profile = cProfile.Profile()
    try:
        return profile.runcall(fn, rank, world_size, *args)
    finally:
        profile.dump_stats(os.path.join(folder, f"{fn.__name__}.rank{rank}.prof"))


def run_ranks(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 120):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of a
    ``backend`` process group (gloo; ``"cpu:gloo,cuda:nccl"`` for GPU tests)
    whose collectives time out after ``timeout_s``."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry,
            args=(world_size, free_port(), out_dir, fn, args, backend, timeout_s, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )
        try:
            while not context.join():
                pass
        except Exception as exc:
            raise AssertionError(_fates(exc, context.processes, out_dir)) from None
        with open(os.path.join(out_dir, "result.pkl"), "rb") as f:
            return pickle.load(f)


def _fates(exc: Exception, processes, out_dir: str) -> str:
    """The failure message: what torch.multiprocessing saw first, then each
    rank's exit (code or signal) with its traceback and native stacks."""
    lines = [f"a rank failed: {type(exc).__name__}: {str(exc).strip()[:2000]}"]
    for rank, process in enumerate(processes):
        code = process.exitcode
        fate = f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit {code}"
        lines.append(f"--- rank {rank}: {fate}")
        for name in (f"error{rank}.txt", f"native{rank}.txt"):
            path = os.path.join(out_dir, name)
            text = open(path).read().strip() if os.path.exists(path) else ""
            if text:
                lines.append(f"[{name}]\n{text}")
    return "\n".join(lines)


def train_step(model, loss, opt, ctx=None) -> tuple[float, float]:
    """Backward ``loss`` (this rank's share of the global token mean: docs/
    long-context.md, "The loss rule"), clip at 1.0 (torch's clip in one
    process, ``ctx.clip_grad_norm`` across ranks) and step ``opt``. Returns
    the loss as the mean over ranks (the global mean) and the pre-clip norm."""
    loss.backward()
    if ctx is None:
        params = [p for p in model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    else:
        norm = ctx.clip_grad_norm(model, 1.0, optimizer=opt)
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    if ctx is not None:
        dist.all_reduce(total)
        total /= ctx.world_size
    return float(total), float(norm)
