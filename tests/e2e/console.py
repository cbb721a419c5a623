"""What a user watches on ``ray-fsdp train``'s console, compared with the docs.

Shared by the quick start's console test (README.md's sample) and the
fine-tuning example's (docs/finetuning.md's sample): a run's whole console,
line for line, against a sample written by ``python -m benchmarks.samples``
from a real run, numbers and paths aside; and no warning, error or traceback
line but those docs/monitoring.md lists as expected.

A sample is a user's run, which starts its own local Ray cluster. A test
that joins the shared cluster (``RAY_ADDRESS``) sees Ray's "connecting"
lines instead of its start lines: :data:`STARTED_CLUSTER` and
:data:`JOINED_CLUSTER` name both, and :func:`assert_console_is_sample`
drops each from its own side only.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours some lines: patterns match the text

STARTED_CLUSTER = [r"INFO worker\.py:\d+ -- Started a local Ray instance"]
"""What only a driver that starts its cluster prints (beside the
token-authentication notice, an expected line in docs/monitoring.md)."""
JOINED_CLUSTER = [
    r"INFO worker\.py:\d+ -- Using address \S+ set in the environment variable RAY_ADDRESS",
    r"INFO worker\.py:\d+ -- Connecting to existing Ray cluster at address",
    r"INFO worker\.py:\d+ -- Connected to Ray cluster",
    r"core_worker\.cc:\d+:? Actor with class name: \W*PreemptionWatcher\W.*constructor "
    r"arguments in the object store",
]
"""What only a driver that joins a running cluster (``RAY_ADDRESS``) prints:
Ray's address lines, and the line Ray Train's ``PreemptionWatcher`` prints
as it starts, which ``ray-fsdp train`` leaves on where it joins a cluster
(docs/monitoring.md; Ray 2.60 creates that actor with worker handles among
its arguments and ``max_restarts=-1``)."""


def expected_console_lines() -> list[str]:
    """The patterns docs/monitoring.md lists under "Expected console lines"."""
    text = (REPO / "docs" / "monitoring.md").read_text()
    block = text.split("<!-- expected console lines -->", 1)[1].split("```", 2)[1]
    return [line for line in block.splitlines() if line.strip()]


_TRACEBACK_START = re.compile(r'^(Traceback \(most recent call last\):|\s+File ")')


def without_expected_tracebacks(log: str) -> list[str]:
    """The log's lines less each traceback whose final (exception) line is an
    expected console line: with worker lines unprefixed (docs/monitoring.md),
    an overloaded controller prints its "Failed to stop PlacementGroupCleaner
    gracefully" traceback (ending in ``GetTimeoutError``) as bare lines, whose
    header Ray's log streaming can deliver after the frames: a block starts at
    the header or at a frame line. Any other traceback stays."""
    allowed = [re.compile(p) for p in expected_console_lines()]
    kept, block = [], None
    for line in _ANSI.sub("", log).splitlines():
        if block is None and _TRACEBACK_START.match(line):
            block = [line]
        elif block is not None and line.startswith("Traceback (most recent call last):"):
            block.append(line)
        elif block is not None and (not line.strip() or line[:1].isspace()):
            block.append(line)
        elif block is not None:  # the exception line ends the traceback
            block.append(line)
            if not any(p.search(line) for p in allowed):
                kept += block
            block = None
        else:
            kept.append(line)
    return kept + (block or [])


def assert_quiet(log: str, *, joined: bool = False) -> None:
    """No warning, error, failure or traceback line but those the docs list
    as expected (and, ``joined``, a joined cluster's :data:`JOINED_CLUSTER`)."""
    allowed = [re.compile(p) for p in expected_console_lines() + JOINED_CLUSTER * joined]
    noisy = re.compile(r"warn|error|fail|traceback|exception", re.I)
    loud = [
        line for line in without_expected_tracebacks(log)
        if noisy.search(line) and not any(p.search(line) for p in allowed)
    ]  # fmt: skip
    assert not loud, "unexpected console lines (docs/monitoring.md lists the expected):\n" + (
        "\n".join(loud[:20])
    )


def assert_console_is_sample(log: str, doc: Path, sample: str, *, joined: bool = False) -> None:
    """The run's whole console, line for line, is ``doc``'s ``sample`` block:
    the same lines in the same order, numbers and paths aside (an MFU column
    and a TensorBoard line the sample's run has not, and the lines
    docs/monitoring.md lists as a crowded machine's, aside). ``joined``: the
    run joined a running cluster, so each side loses its own cluster lines
    (:data:`STARTED_CLUSTER`, :data:`JOINED_CLUSTER`). A new line on the
    console (a library's warning, Ray's prefixes, a traceback) fails."""
    from benchmarks.samples import collapse_progress, console_shape, sample_lines

    optional = [re.compile(p) for p in expected_console_lines()]
    run_only = [re.compile(p) for p in JOINED_CLUSTER] if joined else []
    sample_only = [re.compile(p) for p in STARTED_CLUSTER] if joined else []

    def shown(lines, dropped):
        lines = [re.sub(r"MFU [^|]*\| ", "", ln) for ln in lines if ln.strip()]
        return [ln for ln in lines if not ln.startswith("tensorboard:")
                and not any(p.search(ln) for p in optional + dropped)]  # fmt: skip

    run = console_shape(collapse_progress(shown(without_expected_tracebacks(log), run_only)))
    documented = console_shape(shown(sample_lines(doc.read_text(), sample), sample_only))
    assert run == documented, (
        f"the console is not {doc.relative_to(REPO)}'s {sample!r} sample (regenerate it "
        "with `python -m benchmarks.samples`):\n" + "\n".join(run)
    )
