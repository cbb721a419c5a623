"""Measuring a training loop: :class:`StepMeter`, TensorBoard scalars, a quiet console.

``StepMeter`` counts the tokens each rank trains, times the steps between
logged ones and reads peak memory, and at a logged step reduces them over
all ranks into the dict the loop reports (the arithmetic is in
:mod:`ray_fsdp_backend.metrics.flops`). The loop's own scalars (loss,
gradient norm, skipped steps) stay on the device between logged steps and
go into the same reduction: one device-to-host copy per logged step for all
of them, none in between. ``ctx.step_meter(...)`` builds one with the
model's FLOPs per token and the device's peak FLOP/s already resolved::

    meter = ctx.step_meter(model, seq_len=1024, total_steps=1000)
    for step in range(1, 1001):
        ...
        meter.count_tokens(inputs.numel())        # every micro-batch
        if step % 10 == 0:                        # every rank
            metrics = meter.measure(step, mean={"loss": loss}, same={"grad_norm": norm})
            ray.train.report(metrics)
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import resource
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ray_fsdp_backend.metrics.flops import flops_per_token, throughput_metrics
from ray_fsdp_backend.storage.retry import STATS as STORAGE_RETRIES
from ray_fsdp_backend.strategies.blocks import find_blocks

_GIB = 1024**3


class StepMeter:
    """Throughput, MFU, memory and ETA of a training loop, one rank's view
    reduced over all ranks at each :meth:`measure`; also the storage retries
    of the backend's checkpoint and pretrained I/O since the workers started
    (``storage_retries``: all ranks' retries; ``storage_retry_s``: the most
    seconds one rank spent in them; :mod:`ray_fsdp_backend.storage.retry`).

    Args:
        device: the rank's device (CUDA memory stats on GPU, peak RSS on CPU).
        flops_per_token: training FLOPs per token; None: no TFLOP/s or MFU.
        peak_flops: one device's peak FLOP/s; None: no MFU.
        total_steps: the run's last step, for the ETA.
        start_step: the step the loop starts after (a resumed run's).
        start_tokens: tokens trained before ``start_step``.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        total_steps: int | None = None,
        start_step: int = 0,
        start_tokens: int = 0,
    ) -> None:
        self.device, self.total_steps = device, total_steps
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.tokens_seen = start_tokens
        self._window_tokens = 0
        self._start = self._last = time.perf_counter()
        self._last_step = start_step

    def count_tokens(self, n: int) -> None:
        """Add ``n`` tokens this rank trained (call it per micro-batch)."""
        self._window_tokens += int(n)

    def measure(
        self,
        step: int,
        *,
        mean: Mapping[str, torch.Tensor | float] | None = None,
        same: Mapping[str, torch.Tensor | float] | None = None,
    ) -> dict[str, float]:
        """Metrics over the steps since the previous call, plus ``mean``
        (averaged over ranks, e.g. each rank's loss) and ``same`` (values
        every rank holds alike, e.g. the global gradient norm; their maximum
        is taken), as Python floats. Tensors may stay on the device: all
        values cross to the host in one copy, the only synchronisation. A
        collective: every rank calls it at the same steps with the same keys;
        every rank gets the same dict."""
        mean, same = dict(mean or {}), dict(same or {})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        allocated, reserved = peak_memory_bytes(self.device)
        world = dist.get_world_size() if dist.is_initialized() else 1
        retries, retry_s = STORAGE_RETRIES.snapshot()
        sums = _gather_scalars([float(self._window_tokens), retries, *mean.values()], self.device)
        peaks = _gather_scalars(
            [now - self._last, allocated, reserved, retry_s, *same.values()], self.device
        )
        if world > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        values = torch.cat([sums, peaks]).tolist()  # the one device-to-host copy
        n = len(sums)
        tokens, retries = int(values[0]), int(values[1])
        seconds, allocated, reserved, retry_s = values[n : n + 4]
        out = {k: v / world for k, v in zip(mean, values[2:n], strict=True)}
        out |= dict(zip(same, values[n + 4 :], strict=True))
        self.tokens_seen += tokens
        out |= throughput_metrics(
            tokens=tokens,
            seconds=seconds,
            steps=step - self._last_step,
            world_size=world,
            flops_per_token=self.flops_per_token,
            peak_flops=self.peak_flops,
        )
        out |= {
            "tokens_seen": self.tokens_seen,
            "memory_peak_allocated_gib": allocated / _GIB,
            "memory_peak_reserved_gib": reserved / _GIB,
            "elapsed_s": now - self._start,
            # Since the workers started: a throttled or flaky store shows here.
            "storage_retries": retries,
            "storage_retry_s": retry_s,
        }
        if self.total_steps is not None:
            # From the latest window: the first one may hold compilation.
            out["eta_s"] = out["step_time_s"] * max(0, self.total_steps - step)
        self._window_tokens, self._last, self._last_step = 0, now, step
        return out


def _gather_scalars(values: list[torch.Tensor | float], device: torch.device) -> torch.Tensor:
    """One float64 vector on ``device`` of host floats (one host-to-device
    copy) and 0-d tensors (copied on the device, not read), in order."""
    is_tensor = [isinstance(v, torch.Tensor) for v in values]
    host = [0.0 if t else float(v) for v, t in zip(values, is_tensor, strict=True)]
    out = torch.tensor(host, dtype=torch.float64, device=device)
    for i, v in enumerate(values):
        if is_tensor[i]:
            out[i] = v.detach().reshape(())
    return out


def peak_memory_bytes(device: torch.device) -> tuple[float, float]:
    """(allocated, reserved) peak bytes of this rank. CUDA: the caching
    allocator's peaks since the previous call (they are reset). CPU: the
    process's peak resident set size, for both."""
    if device.type == "cuda":
        out = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        return float(out[0]), float(out[1])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return float(rss), float(rss)


def estimate_flops_per_token(
    model: nn.Module, seq_len: int, block_classes: tuple[str, ...] = ()
) -> int:
    """FLOPs per token of a decoder transformer, read off the module:
    parameters (each counted once, sharded or not) minus input embeddings
    not tied to a head, blocks found as the FSDP wrap policy finds them, and
    the embedding width as attention width. For other shapes pass
    ``flops_per_token`` yourself."""
    params = {id(p): p for p in model.parameters()}
    head_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    embedding_only = sum(m.weight.numel() for m in embeddings if id(m.weight) not in head_params)
    width = max((m.embedding_dim for m in embeddings), default=0)
    return flops_per_token(
        sum(p.numel() for p in params.values()) - embedding_only,
        n_layers=count_blocks(model, block_classes),
        attn_width=width,
        seq_len=seq_len,
    )


def count_blocks(model: nn.Module, block_classes: tuple[str, ...] = ()) -> int:
    """Blocks as the wrap policy finds them, also after wrapping: ``fully_shard``
    turns a block's class into a subclass named ``FSDP<name>``, so listed
    class names are matched along the class hierarchy."""
    if not block_classes:
        return len(find_blocks(model))
    wanted = set(block_classes)
    return sum(any(c.__name__ in wanted for c in type(m).__mro__) for m in model.modules())


class TensorBoardWriter:
    """Every numeric metric as a TensorBoard scalar under ``log_dir``
    (``torch.utils.tensorboard``; needs the ``tensorboard`` package, the
    ``[tensorboard]`` extra). Rank 0 writes; open it with
    ``tensorboard --logdir <log_dir>``."""

    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "logging.tensorboard needs tensorboard: pip install 'ray_fsdp_backend[tensorboard]'"
            ) from exc
        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def show_ray_report_lines(show: bool) -> None:
    """Show (True) or hide Ray Train's INFO line "Reporting training result
    N: TrainingReport(...)" that every ``ray.train.report`` prints on every
    worker (Ray 2.60). Ray logs it through a logger named by the file path of
    ``ray/train/v2/_internal/execution/context.py`` (not under ``ray.train``),
    so ``RunConfig(logging_config=...)`` levels do not reach it; its own
    level does. Call it on the worker."""
    try:
        from ray.train.v2._internal.execution import context as ray_context
    except ImportError:  # another Ray version: nothing to quieten
        return
    logger = logging.getLogger(ray_context.__file__)
    logger.setLevel(logging.NOTSET if show else logging.WARNING)


def quiet_console(verbose: bool) -> None:
    """The one place a worker's console is quietened (``ray-fsdp train``
    calls it on every worker; ``--verbose`` / ``logging.verbose: true``
    shows everything): Ray Train's per-report lines
    (:func:`show_ray_report_lines`) and warnings raised by libraries we call,
    each named here with the version it applies to. Expected lines that
    remain are listed in docs/monitoring.md."""
    show_ray_report_lines(verbose)
    if verbose:
        return
    for name, level in QUIET_RAY_DATA_LOGGERS.items():  # this worker's own executions
        logging.getLogger(name).setLevel(level)
    # peft 0.21's get_peft_model reads model.is_gradient_checkpointing
    # (peft/peft_model.py), a property transformers 5.x deprecated in favour
    # of is_activation_checkpointing: a FutureWarning per worker that no
    # setting of ours avoids.
    warnings.filterwarnings(
        "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
    )


QUIET_RAY_DATA_LOGGERS = {
    # Ray 2.60 warns "Progress bars disabled. To enable, set ..." once per
    # process that runs a dataset with progress bars off (the driver, each
    # split's coordinator, each worker reading the held-out set).
    "ray.data._internal.progress": "ERROR",
    # Ray 2.60 logs "Dataset NAME execution finished in N seconds" at INFO for
    # every execution: each epoch of a streamed split, each held-out pass.
    "ray.data._internal.execution.streaming_executor": "WARNING",
}
"""Ray Data's loggers a quiet console raises above the lines it would print
(``ray-fsdp train`` without ``-v``); the levels apply to Ray Data's log file
(``logs/ray-data/ray-data.log`` in the session) too."""

RAY_DATA_LOGGING_CONFIG = "RAY_DATA_LOGGING_CONFIG"
"""Ray Data's variable naming its logging config (a YAML file), read by
every process when it imports ``ray.data``."""


def quiet_ray_data_console() -> None:
    """Ray Data's console without the lines :data:`QUIET_RAY_DATA_LOGGERS`
    names, in this process and in every process started after this call with
    its environment (a local cluster's: the split coordinators, Ray Data's
    tasks, the training workers). Ray Data configures its loggers from the
    YAML file :data:`RAY_DATA_LOGGING_CONFIG` names; this writes Ray's own
    default config with those levels added to a file in the temporary
    directory (named by its content) and points the variable at it. A config
    of the user's (the variable set already) is left alone. Call it on the
    driver before Ray starts."""
    if RAY_DATA_LOGGING_CONFIG in os.environ:
        return
    from ray.data._internal import logging as data_logging

    config = copy.deepcopy(data_logging.DEFAULT_CONFIG)
    config["loggers"].update({name: {"level": lv} for name, lv in QUIET_RAY_DATA_LOGGERS.items()})
    text = json.dumps(config, sort_keys=True)  # JSON is YAML
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"ray_fsdp_backend-ray-data-logging-{digest}.yaml")
    if not os.path.exists(path):
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False) as f:
            f.write(text)
        os.replace(f.name, path)  # whole or absent: another run may read it now
    os.environ[RAY_DATA_LOGGING_CONFIG] = path
    data_logging.configure_logging()
