"""The console checks of the quick start and fine-tuning runs
(``tests/e2e/console.py``) can fail: on the docs' own samples, with one line
added that a user should not see, they raise; with only the lines
docs/monitoring.md lists as expected, or a joined cluster's "connecting"
lines in place of a started one's, they pass. No Ray here."""

from __future__ import annotations

import pytest

from benchmarks.samples import sample_lines
from tests.e2e.console import REPO, assert_console_is_sample, assert_quiet

README = REPO / "README.md"
FINETUNING = REPO / "docs" / "finetuning.md"

UNEXPECTED = {
    "torchao": [
        "Failed to load /usr/lib/python3/site-packages/torchao/_C_mxfp8.so: libcuda.so.1: "
        "cannot open shared object file"
    ],
    "warning": ["/x/transformers/modeling_utils.py:3314: FutureWarning: `x` is deprecated"],
    "traceback": [
        "Traceback (most recent call last):",
        '  File "/x/ray_fsdp_backend/trainer/train.py", line 3, in <module>',
        "ValueError: something broke",
    ],
    "traceback, frames first": [
        '  File "/x/ray_fsdp_backend/trainer/train.py", line 3, in <module>',
        "    run()",
        "Traceback (most recent call last):",
        "ValueError: something broke",
    ],
    # What a cleaner that searched the host for its cluster printed, before
    # ray_fsdp_backend.runtime.ray_start pinned it (the e2e quick start runs beside a second
    # cluster).
    "cleaner searching the host": [
        "Exception in thread PlacementGroupCleanerMonitor:",
        "Traceback (most recent call last):",
        '  File "/x/ray/_private/services.py", line 760, in canonicalize_bootstrap_address_or_die',
        "ConnectionError: Found multiple active Ray instances: {'127.0.0.1:6379', '10.0.0.2:6379'}",
    ],
    "ray prefix": [
        "(RayTrainWorker pid=123) step   1/150 | loss 5.5914 | grad norm 6.272 | lr 2.00e-04 | "
        "3,838 tok/s (1,919/rank) | 534 ms/step | mem 0.55 GiB | ETA 00:01:19"
    ],
}
EXPECTED_TRACEBACK = [  # an overloaded controller stopping the cleaner (docs/monitoring.md)
    "Failed to stop PlacementGroupCleaner gracefully.",
    "Traceback (most recent call last):",
    '  File "/x/ray/train/v2/_internal/callbacks/placement_group_callback.py", line 126, in _stop',
    "ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready.",
]


FRAMES_FIRST = [  # the same as .ci/run once streamed one: the header after the frames
    "Failed to stop PlacementGroupCleaner gracefully.",
    '  File "/x/ray/train/v2/_internal/callbacks/placement_group_callback.py", line 126, in _stop',
    "    ray.get(self._cleaner.stop.remote(), timeout=self._stop_timeout)",
    "Traceback (most recent call last):",
    "ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready.",
]


def _sample(doc, name: str) -> list[str]:
    lines = sample_lines(doc.read_text(), name)
    assert len(lines) > 5, f"{doc.name}'s {name!r} sample is not written yet"
    return lines


def _with(lines: list[str], extra: list[str], at: int = 3) -> str:
    return "\n".join(lines[:at] + extra + lines[at:])


@pytest.mark.parametrize("doc,name", [(README, "quickstart"), (FINETUNING, "finetune_hf")])
def test_a_sample_passes_and_any_unexpected_line_fails(doc, name):
    lines = _sample(doc, name)
    assert_console_is_sample("\n".join(lines), doc, name)
    assert_quiet("\n".join(lines))
    assert_console_is_sample(_with(lines, EXPECTED_TRACEBACK), doc, name)
    assert_console_is_sample(_with(lines, FRAMES_FIRST), doc, name)
    for what, extra in UNEXPECTED.items():
        with pytest.raises(AssertionError):
            assert_console_is_sample(_with(lines, extra), doc, name)
        if what != "ray prefix":  # a prefixed line is no warning: the comparison catches it
            with pytest.raises(AssertionError):
                assert_quiet(_with(lines, extra))


JOINED = [  # what test_finetune_hf's run printed, having joined the shared cluster
    "2026-12-06 20:57:01,012\tINFO worker.py:1692 -- Using address 127.0.0.1:6379 set in the "
    "environment variable RAY_ADDRESS",
    "\x1b[33m[2026-12-06 20:57:09,104 E 20731 20731] core_worker.cc:2876: Actor with class "
    "name: \x1b[1m'PreemptionWatcher'\x1b[0m and ID: '5f9b6c1e0a3d4e2f01000000' has "
    "constructor arguments in the object store and max_restarts > 0. If the arguments in the "
    "object store go out of scope or are lost, the actor restart will fail. See "
    "https://github.com/ray-project/ray/issues/53727 for more details.\x1b[0m",
]


def test_a_joined_cluster_trades_its_own_lines_for_the_start_line():
    lines = _sample(FINETUNING, "finetune_hf")
    start = next(i for i, ln in enumerate(lines) if "Started a local Ray instance" in ln)
    joined = "\n".join(lines[:start] + JOINED[:1] + lines[start + 1 : start + 3] + JOINED[1:]
                       + lines[start + 3 :])  # fmt: skip
    assert_console_is_sample(joined, FINETUNING, "finetune_hf", joined=True)
    assert_quiet(joined, joined=True)
    with pytest.raises(AssertionError):  # the same lines from a run said to start its cluster
        assert_console_is_sample(joined, FINETUNING, "finetune_hf")
    with pytest.raises(AssertionError):  # the watcher's line is no expected line there
        assert_quiet(joined)
    with pytest.raises(AssertionError):  # a joined run still may not add a line
        torchao = _with(joined.splitlines(), UNEXPECTED["torchao"])
        assert_console_is_sample(torchao, FINETUNING, "finetune_hf", joined=True)


@pytest.mark.parametrize(
    "line",
    [
        # Ray 2.60's own formats, filled as Ray fills them (placement_group_cleaner.py:
        # "%.2f"; a "\d+ seconds" pattern missed "5.00 seconds" and failed .ci/run).
        f"Monitor thread did not exit within {5.0:.2f} seconds",
        "Failed to stop PlacementGroupCleaner gracefully.",
    ],
)
def test_rays_teardown_lines_on_a_crowded_machine_are_expected(line):
    import re

    from tests.e2e.console import expected_console_lines

    assert any(re.search(p, line) for p in expected_console_lines()), line
