"""The collective weight sync (``rollout.transport: collective``, docs/rl.md) on
a local Ray cluster: 2 gloo trainer ranks (FSDP2, ``ctx.stream_weights``) and
2 transformers rollout engines (Ray actors, restarted when killed).

1. A collective sync makes every engine hold the export's tensors bit for
   bit (they held the checkpoint's) and decode greedily as transformers does
   on the export.
2. Engine 0 killed (Ray restarts it with the checkpoint's weights), an
   object-store sync makes it the export again: the same tensors and greedy
   tokens as the collective sync gave.
3. After another training step, a collective sync first re-forms the group
   (engine 0 came back in none) and every engine holds the new export; a
   second one reuses the group.

The trainer's own process group is untouched (an all-reduce after the
syncs); the bytes and seconds of every sync are printed (the first and the
rejoining collective syncs form a group).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from ray_fsdp_backend import FSDPSettings, load_pretrained
from ray_fsdp_backend.hf import export_model
from ray_fsdp_backend.hf.models import build_causal_lm
from ray_fsdp_backend.runtime.worker import setup_process_context
from tests.dist.harness import run_ranks
from tests.hf_models import fine_tune, read_safetensors, save_tiny_pretrained

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

NAMESPACE, ENGINES = "rfb-test-transport", ("engine-0", "engine-1")
BUCKET = 8 * 1024  # bytes: several buckets of the tiny model
PROMPTS = [[2, 10, 11, 12], [2, 20, 21]]


def _state(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def _engines_now(engines) -> dict:
    import ray

    return {
        "state": ray.get([e.__ray_call__.remote(_state) for e in engines]),
        "greedy": [
            ray.get(e.generate.remote(PROMPTS, max_tokens=8, temperature=0))["samples"]
            for e in engines
        ],
    }


def _sync(ctx, model, fleet, engines) -> dict:
    from ray_fsdp_backend.rl.fleet import sync_weights

    stats = sync_weights(ctx, model, fleet, bucket_bytes=BUCKET)
    seen = _engines_now(engines) if fleet is not None else {}
    return {"seconds": stats.seconds, "bytes": stats.bytes, **seen}


def _restart(engine) -> None:
    """Kill ``engine`` and wait for Ray to restart it (another process)."""
    import ray

    pid = ray.get(engine.__ray_call__.remote(lambda _: os.getpid()))
    ray.kill(engine, no_restart=False)
    while ray.get(engine.__ray_call__.remote(lambda _: os.getpid())) == pid:
        time.sleep(0.1)


def _trainer(rank: int, world: int, path: str, root: str, address: str) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    ctx = setup_process_context(FSDPSettings(use_mixed_precision=False), torch.device("cpu"))
    model = ctx.wrap(build_causal_lm(path))
    load_pretrained(model, path)
    fine_tune(model, rank, world)
    engines = fleets = None
    if rank == 0:  # the sync's driver, as in the loop: the one rank that talks to Ray
        import ray

        from ray_fsdp_backend.rl.fleet import RolloutFleet

        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        engines = [ray.get_actor(name) for name in ENGINES]
        ray.get([e.get_version.remote() for e in engines])  # started
        fleets = {t: RolloutFleet(engines, transport=t) for t in ("collective", "object_store")}
    out = {"export": [export_model(model, os.path.join(root, "export0"))]}
    out["collective"] = _sync(ctx, model, fleets and fleets["collective"], engines)
    if rank == 0:
        _restart(engines[0])
    out["object_store"] = _sync(ctx, model, fleets and fleets["object_store"], engines)
    fine_tune(model, rank, world, steps=1)
    out["export"].append(export_model(model, os.path.join(root, "export1")))
    out["rejoined"] = _sync(ctx, model, fleets and fleets["collective"], engines)
    out["again"] = _sync(ctx, model, fleets and fleets["collective"], engines)  # the same group
    total = torch.ones(1)
    torch.distributed.all_reduce(total)  # the default group, after the syncs
    out["all_reduce"] = float(total)
    return out


def _greedy(directory: str) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    return [
        model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, pad_token_id=3)[
            0, len(p) :
        ].tolist()
        for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory, ray_local, ray_address):
    from ray_fsdp_backend.rl.rollout_hf import HFRollout

    root = tmp_path_factory.mktemp("transport")
    path = save_tiny_pretrained("llama", root / "llama")
    options = dict(num_cpus=0, namespace=NAMESPACE, max_restarts=-1, max_task_retries=-1)
    engine = ray_local.remote(HFRollout)
    engines = [engine.options(name=name, **options).remote(path) for name in ENGINES]
    try:
        yield path, run_ranks(_trainer, 2, path, str(root), ray_address, timeout_s=300)
    finally:
        for e in engines:
            ray_local.kill(e)


def _assert_engines_hold(seen: dict, exported: dict[str, torch.Tensor]) -> None:
    for state in seen["state"]:
        assert state.keys() == exported.keys()
        for name, tensor in exported.items():
            assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name


def test_a_collective_sync_gives_every_engine_the_export(run):
    path, out = run
    exported = read_safetensors(out["export"][0])
    checkpoint = read_safetensors(path)
    assert any(not torch.equal(checkpoint[k], exported[k]) for k in exported)  # trained
    _assert_engines_hold(out["collective"], exported)
    expected = _greedy(out["export"][0])
    for greedy in out["collective"]["greedy"]:
        for tokens, (sample,) in zip(expected, greedy, strict=True):
            assert sample["token_ids"] == tokens[: len(sample["token_ids"])]  # to its eos


def test_the_object_store_sync_gives_the_same_weights_and_tokens(run):
    _, out = run
    _assert_engines_hold(out["object_store"], read_safetensors(out["export"][0]))
    assert out["object_store"]["greedy"] == out["collective"]["greedy"]
    for name in ("collective", "object_store", "rejoined", "again"):
        sync = out[name]
        print(f"{name}: {sync['bytes']} bytes to each of 2 engines in {sync['seconds']:.3f} s")
    assert out["object_store"]["bytes"] == out["collective"]["bytes"] > 0


def test_a_restarted_engine_rejoins_and_the_trainer_group_is_untouched(run):
    _, out = run
    _assert_engines_hold(out["rejoined"], read_safetensors(out["export"][1]))
    _assert_engines_hold(out["again"], read_safetensors(out["export"][1]))
    assert out["all_reduce"] == 2.0
