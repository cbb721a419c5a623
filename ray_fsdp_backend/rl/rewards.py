"""Reward functions named ``module:function``, run in Ray tasks beside the training.

A reward function has TRL's signature, so functions written for
``GRPOTrainer`` work unchanged::

    def reward(prompts: list, completions: list[str], **fields) -> list[float]

``prompts`` are the records' prompts as written (text or messages),
``completions`` the decoded responses, and every other field of the prompt
records comes as a keyword argument holding one value per completion (a
reference answer, a test case). :func:`score` runs it over the batch in
Ray tasks of ``chunk`` completions each (a slow verifier does not hold the
trainer's rank 0), and checks what comes back.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence


def load_reward(entry: str) -> Callable:
    """The function ``entry`` (``package.module:function``) names.

    Raises:
        ValueError: ``entry`` is not ``module:function``, its module does not
            import, or it has no such callable."""
    module_name, sep, name = entry.partition(":")
    if not sep or not module_name or not name.isidentifier():
        raise ValueError(f"reward={entry!r} must be 'module:function' (e.g. my_rewards:exact)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"reward={entry!r}: module {module_name!r} does not import ({exc})"
        ) from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward={entry!r}: {module_name} has no function {name!r}")
    return fn


def call_reward(
    entry: str, prompts: Sequence, completions: Sequence[str], fields: Mapping[str, Sequence]
) -> list[float]:
    """``entry``'s rewards for one chunk, checked: one finite number per completion.

    Raises:
        ValueError: the function returned something else (named)."""
    fn = load_reward(entry)
    try:
        rewards = fn(prompts=list(prompts), completions=list(completions), **fields)
    except Exception as exc:
        raise ValueError(f"reward {entry} raised {type(exc).__name__}: {exc}") from exc
    try:
        values = [float(r) for r in rewards]
    except (TypeError, ValueError):
        raise ValueError(
            f"reward {entry} returned {type(rewards).__name__} {str(rewards)[:80]!r}: "
            "it must return a list of numbers, one per completion"
        ) from None
    if len(values) != len(completions):
        raise ValueError(
            f"reward {entry} returned {len(values)} values for {len(completions)} completions"
        )
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise ValueError(f"reward {entry} returned non-finite values at completions {bad[:5]}")
    return values


def score(
    entry: str,
    prompts: Sequence,
    completions: Sequence[str],
    fields: Mapping[str, Sequence],
    *,
    chunk: int = 64,
) -> list[float]:
    """The rewards of ``completions`` (one per completion; ``prompts`` and
    each of ``fields`` aligned with them), computed by ``entry`` in Ray
    tasks of ``chunk`` completions."""
    import ray

    task = ray.remote(num_cpus=0)(call_reward)
    refs = [
        task.remote(
            entry,
            prompts[i : i + chunk],
            completions[i : i + chunk],
            {k: list(v[i : i + chunk]) for k, v in fields.items()},
        )
        for i in range(0, len(completions), chunk)
    ]
    return [value for part in ray.get(refs) for value in part]
