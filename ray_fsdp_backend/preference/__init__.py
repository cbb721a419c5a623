"""Preference tuning (DPO and its family, reward models) from packed pair rows.

Pairs of responses to one prompt become packed token rows (:mod:`.pairs`,
:mod:`.render`, :mod:`.packing`, :mod:`.check`, :mod:`.dataset`).
:mod:`.losses` holds every loss as a function of per-sequence log-prob sums
(:func:`~.losses.dpo_loss`: sigmoid, ipo, hinge, robust, simpo, orpo;
:func:`~.losses.reward_loss`: Bradley-Terry); :mod:`.log_probs` turns a
micro-batch of packed pairs into those sums under any layout
(:func:`~.log_probs.pair_log_probs`, through ``ctx.sequence_log_probs``:
never the ``[tokens, vocab]`` logits). See docs/preference.md.
"""
