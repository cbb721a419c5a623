"""Pure checkpoint decisions: names, completeness, resume choice, key mismatches."""

from __future__ import annotations

import pytest

from ray_fsdp_backend.checkpoint.layout import (
    checkpoint_name,
    choose_resume,
    compute_key_mismatch,
    compute_restart_deletions,
    compute_retention_deletions,
    decode_marker,
    encode_marker,
    names_in,
    newest_complete,
    next_checkpoint_name,
    stale_partials,
)
from ray_fsdp_backend.checkpoint.store import CheckpointStore

DONE = encode_marker(world_size=2, strategy="FSDPStrategy", step=4)


def test_names_sort_in_save_order_and_skip_partials():
    assert checkpoint_name(7) == "checkpoint_000007"
    assert next_checkpoint_name([]) == "checkpoint_000001"
    # A partial directory (3) is never reused; foreign names are ignored.
    names = ["checkpoint_000001", "checkpoint_000003", "checkpoint_2025-01-01_00-00", "x"]
    assert next_checkpoint_name(names) == "checkpoint_000004"
    assert next_checkpoint_name(["checkpoint_1000000"]) == "checkpoint_1000001"


def test_marker_round_trip_and_cut_short_marker_is_incomplete():
    assert decode_marker(DONE)["step"] == 4
    assert decode_marker(None) is None
    assert decode_marker(DONE[: len(DONE) // 2]) is None
    assert decode_marker('{"world_size": "2"}') is None


def test_newest_complete_ignores_incomplete_newer_ones():
    markers = {
        "checkpoint_000002": DONE,
        "checkpoint_000010": DONE,
        "checkpoint_000011": None,  # crashed during save
        "checkpoint_000012": DONE[:5],  # marker cut short
    }
    assert newest_complete(markers) == "checkpoint_000010"
    assert newest_complete({"checkpoint_000001": None}) is None
    assert stale_partials(markers, "checkpoint_000013") == [
        "checkpoint_000011",
        "checkpoint_000012",
    ]
    assert stale_partials(markers, "checkpoint_000011") == []


def test_resume_prefers_newest_complete_of_the_run_over_rays_handed_one():
    run = {"checkpoint_000001": DONE, "checkpoint_000002": DONE}
    assert choose_resume(run, DONE, has_handed=True).name == "checkpoint_000002"
    assert choose_resume({}, None, has_handed=False) is None
    assert choose_resume({"checkpoint_000001": None}, DONE, has_handed=True).handed
    with pytest.raises(ValueError, match="COMPLETE"):
        choose_resume({}, None, has_handed=True)


def test_key_mismatch_names_missing_unexpected_and_wrong_shapes():
    want = {"model.a": (2, 3), "model.b": (4,), "model.c": None, "optim.param_groups.0.lr": None}
    have = {"model.a": (3, 3), "model.c": None, "model.z": (1,), "other.x": (1,)}
    mismatch = compute_key_mismatch(want, have, ("model.",))
    assert mismatch.missing == ("model.b",)
    assert mismatch.unexpected == ("model.z",)
    assert mismatch.wrong_shape == (("model.a", (2, 3), (3, 3)),)
    text = mismatch.describe()
    assert "missing in checkpoint: model.b" in text
    assert "not in model: model.z" in text
    assert "model.a (model [2, 3], checkpoint [3, 3])" in text
    assert not compute_key_mismatch(want, want, ("model.",))
    many = compute_key_mismatch({f"model.k{i}": (1,) for i in range(15)}, {}, ("model.",))
    assert "and 5 more" in many.describe(limit=10)


def test_store_lists_checkpoints_and_writes_whole_markers(tmp_path):
    store = CheckpointStore.local(tmp_path)
    assert store.list_checkpoints() == []
    for name in ("checkpoint_000001", "checkpoint_000002", "not_a_checkpoint"):
        (tmp_path / name).mkdir()
    store.write_marker("checkpoint_000001", DONE)
    assert store.read_markers() == {"checkpoint_000001": DONE, "checkpoint_000002": None}
    assert not list(tmp_path.glob("**/*.tmp"))
    assert CheckpointStore.local(tmp_path / "absent").list_checkpoints() == []


def _done(step: int) -> str:
    return encode_marker(world_size=2, strategy="s", step=step)


def test_retention_deletes_unregistered_complete_checkpoints_beyond_num_to_keep():
    names = [checkpoint_name(i) for i in range(1, 7)]
    # 1, 3 registered; 2 and 4 completed by workers killed before Ray registered
    # them; 5 registered; 6 just committed (its report not registered yet).
    markers = {n: _done(i) for i, n in enumerate(names, 1)}
    markers[checkpoint_name(7)] = None  # being written
    known = names_in(
        '{"checkpoint_dir_name": "checkpoint_000001", "x": "checkpoint_000003",'
        ' "y": "checkpoint_000005"}'
    )
    assert known == {names[0], names[2], names[4]}
    # Keep the newest 2 complete (5, 6); orphans 2 and 4 go; 1 and 3 are Ray's to delete.
    assert compute_retention_deletions(markers, known, 2) == [names[1], names[3]]
    # An orphan newer than everything Ray registered may still be registered: kept.
    assert compute_retention_deletions(markers, {names[0]}, 1) == []
    assert compute_retention_deletions(markers, known, None) == []
    assert compute_retention_deletions(markers, set(), 1) == []
    # The newest complete checkpoint is never deleted, even unregistered.
    assert names[5] not in compute_retention_deletions(markers, set(names[:5]), 1)


def test_a_new_worker_group_deletes_what_ray_will_never_register():
    # The failed CI run's store when the last worker group started: 3 (step 4)
    # and 5 (step 6) complete, 4 and 6 half-written by killed workers, Ray
    # registered none of them (it drops a shut-down group's pending reports).
    names = {i: checkpoint_name(i) for i in range(1, 8)}
    markers = {names[1]: None, names[3]: _done(3), names[4]: None, names[5]: _done(5)}
    markers[names[6]] = "{cut short"
    # At the commit of 7, retention alone cannot tell 3 from a pending report.
    markers_at_end = {**markers, names[7]: _done(7)}
    assert compute_retention_deletions(markers_at_end, set(), 1) == []
    # At the start of the group: the debris and 3 go, 5 (the newest complete)
    # stays, and so does 6, the newest name (the next one must come after it).
    assert compute_restart_deletions(markers, set(), 1) == [names[i] for i in (1, 3, 4)]
    assert next_checkpoint_name(markers) == names[7]
    # Registered checkpoints are Ray's to delete, complete or not.
    assert compute_restart_deletions(markers, {names[3], names[4]}, 1) == [names[1]]
    # Without num_to_keep every complete checkpoint stays; debris still goes.
    assert compute_restart_deletions(markers, set(), None) == [names[1], names[4]]
    assert compute_restart_deletions(markers, set(), 2) == [names[1], names[4]]
    # The newest directory complete: every incomplete one goes.
    assert compute_restart_deletions(markers_at_end, set(), 1) == [
        names[i] for i in (1, 3, 4, 5, 6)
    ]


def test_unreachable_store_raises_instead_of_looking_incomplete():
    """A marker that cannot be read because the server is gone must not read
    as "no marker": the commit would delete that complete checkpoint as a
    partial one."""
    from tests.conftest import moto_server

    with moto_server() as server:
        store = CheckpointStore(server.filesystem(), "unit-gone/run")
        store.fs.create_dir("unit-gone")
        store.write_marker(checkpoint_name(1), DONE)
        assert store.read_marker(checkpoint_name(1)) == DONE
        assert store.read_marker(checkpoint_name(2)) is None
    with pytest.raises(OSError, match="unit-gone"):
        store.read_marker(checkpoint_name(1))
