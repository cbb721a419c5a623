"""A rollout engine on ``transformers``' ``generate``: for tests, tiny models and CPU clusters.

The same interface as the vLLM engine (:mod:`.rollout_vllm`): the trainer's
loop calls :meth:`HFRollout.generate` with prompt token ids and sampling
parameters, and :meth:`HFRollout.load_weights` with the buckets of
``ctx.stream_weights`` (Hugging Face names, full tensors) or, with
``rollout.transport: collective``, :meth:`HFRollout.receive_weights` with
each bucket's manifest, its tensors broadcast over the weight group the
engine joined (:meth:`HFRollout.join_weight_group`). It runs as a Ray
actor (``ray.remote(HFRollout)``), in a Python environment of its own if
need be: this module imports nothing of ``ray_fsdp_backend`` (a test keeps
it so), only torch and transformers.

Each sample's log-probs are those of the distribution it was sampled from:
``log_softmax(logits / temperature)`` of the model's raw logits, with no
top-k (transformers' default of 50 is turned off) and ``top_p`` 1 unless
given, so that a policy gradient on the samples is on-policy; the trainer
compares them with its own (the trainer / rollout log-prob gap).

Built with ``lora`` (``peft.LoraConfig``'s arguments: the run's ``r``,
``lora_alpha``, ``target_modules``), the engine holds the checkpoint's base
wrapped as a PEFT model and a sync sets its adapters alone, under PEFT's
saved names (``ctx.stream_weights(model, adapters=True)``,
``rollout.sync: adapters``); the base is loaded once and never sent.
"""

from __future__ import annotations

import torch


class HFRollout:
    """A causal LM loaded from a Hugging Face checkpoint, sampling with ``generate``.

    Args:
        model_path: the checkpoint (a local directory: the trainer's
            ``model.pretrained``).
        dtype: the weights' dtype (``float32``, ``bfloat16``).
        device: where it runs (``cpu``, ``cuda``).
        lora: ``peft.LoraConfig``'s keyword arguments: the syncs send the
            adapters alone (None: the whole model, merged).
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        lora: dict | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        if lora is not None:
            from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

            model = get_peft_model(model, LoraConfig(**lora))  # lora_B zero: the base until a sync
        self.model = model.to(device).eval()
        # The names a sync fills -> views of the model's tensors (a state dict shares
        # their storage): transformers' names, or PEFT's saved names of the adapters.
        self.weights = (
            self.model.state_dict() if lora is None else get_peft_model_state_dict(self.model)
        )
        self.device = torch.device(device)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.version = 0
        """The weights' version: 0 the checkpoint's, then the trainer's sync count."""
        self.weight_group = None
        """The trainer's weight group this engine joined (a collective sync's)."""

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
        """``n`` samples for each prompt (token ids): ``{"version": the
        engine's weight version, "samples": per prompt a list of
        {"token_ids": [...], "log_probs": [...], "finished": bool}}``, each
        response up to and including its end-of-sequence token (``finished``)
        or ``max_tokens`` long. ``temperature`` 0 is greedy (log-probs at
        temperature 1). Seeded: the same call gives the same samples."""
        torch.manual_seed(seed)
        sample = temperature > 0
        options = dict(
            do_sample=sample,
            max_new_tokens=max_tokens,
            num_return_sequences=n,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=next(iter(self.eos), 0),
        )
        if sample:
            options.update(temperature=temperature, top_k=0, top_p=top_p)
        results = []
        with torch.no_grad():
            for prompt in prompts:
                ids = torch.tensor([prompt], device=self.device)
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **options)
                tokens = out.sequences[:, ids.shape[1] :]
                logits = torch.stack(out.logits, dim=1).float()  # [n, new, vocab], raw
                scale = temperature if sample else 1.0
                log_probs = torch.log_softmax(logits / scale, dim=-1)
                picked = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
                results.append([self._sample(t, p) for t, p in zip(tokens, picked, strict=True)])
        return {"version": self.version, "samples": results}

    def _sample(self, tokens: torch.Tensor, log_probs: torch.Tensor) -> dict:
        ids = tokens.tolist()
        end = next((i + 1 for i, t in enumerate(ids) if t in self.eos), None)
        length = len(ids) if end is None else end
        return {
            "token_ids": ids[:length],
            "log_probs": log_probs[:length].tolist(),
            "finished": end is not None,
        }

    def load_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """Copy one bucket of ``ctx.stream_weights`` into the model in place
        (Hugging Face names, or PEFT's adapter names when built with
        ``lora``); returns the bytes taken.

        Raises:
            KeyError: a name the model (or its adapters) does not have."""
        unknown = [name for name, _ in bucket if name not in self.weights]
        if unknown:
            raise KeyError(f"weights this model does not have: {unknown[:5]}")
        with torch.no_grad():
            for name, tensor in bucket:
                self.weights[name].copy_(tensor)
        return sum(t.nbytes for _, t in bucket)

    def weight_receiver(self) -> dict:
        """What a collective sync asks first: the ranks this engine takes in
        a weight group, its device type and the group it is in (None: none)."""
        group = self.weight_group.address.name if self.weight_group else None
        return {"ranks": 1, "device": self.device.type, "group": group}

    def join_weight_group(self, group, rank: int) -> None:
        """Join the trainer's weight group (a ``WeightGroup``, sent by value)
        as ``rank``; returns once every member has joined."""
        import ray

        self.weight_group = group.join(rank, ray.util.get_node_ip_address())

    def receive_weights(self, manifest: list) -> int:
        """Receive the bucket ``manifest`` names from the weight group and
        load it (:meth:`load_weights`); returns its bytes."""
        if self.weight_group is None:
            raise RuntimeError("receive_weights: this engine has joined no weight group")
        return self.load_weights(self.weight_group.receive(manifest))

    def finish_sync(self, version: int) -> None:
        """Mark a weight sync complete: the engine now holds weight ``version``."""
        self.version = version

    def get_version(self) -> int:
        """The weight version the engine holds (0: the checkpoint's)."""
        return self.version

    def sleep(self) -> None:
        """Release the engine's device memory until :meth:`wake_up` (a
        colocated trainer's turn). On a GPU the model moves to host memory
        (``nn.Module.to``: the same parameter objects, so a weight sync while
        asleep loads into them there) and the allocator's cache is emptied;
        ``generate`` allocates its KV cache per call, so nothing else is
        held. On CPU a no-op: the weights already live in host memory, and
        moving them to the meta device would lose them until the next full
        sync (a restarted engine, a resumed run's first step need them)."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the device memory back (vLLM's tags: ``["weights"]`` before a
        weight sync, ``["kv_cache"]`` before generating, None both): the
        weights move back to the engine's device; the KV cache is a no-op
        here (made per ``generate`` call). On CPU a no-op (see :meth:`sleep`)."""
        if self.device.type != "cpu" and (tags is None or "weights" in tags):
            self.model.to(self.device)
