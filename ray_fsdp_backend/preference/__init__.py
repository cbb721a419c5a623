"""Preference tuning (DPO and its family, reward models) from packed pair rows.

The rows: :mod:`.pairs` (a ``{prompt, chosen, rejected}`` record, checked),
:mod:`.render` (its two token documents), :mod:`.packing` (PURE: pairs into
rows), :mod:`.check` (every record on the driver), :mod:`.dataset`
(:func:`~.dataset.preference_dataset` on Ray Data); docs/preference-rows.md.

:mod:`.losses` holds every loss as a function of per-sequence log-prob sums
(:func:`~.losses.dpo_loss`: sigmoid, ipo, hinge, robust, simpo, orpo;
:func:`~.losses.reward_loss`: Bradley-Terry); :mod:`.log_probs` turns a
micro-batch of packed pairs into those sums under any layout
(:func:`~.log_probs.pair_log_probs`, through ``ctx.sequence_log_probs``:
never the ``[tokens, vocab]`` logits); :mod:`.reward` gives a reward model's
score of each pair's answers (:func:`~.reward.pair_scores`). See
docs/preference.md.
"""
