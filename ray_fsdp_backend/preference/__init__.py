"""Preference tuning: pairs of responses to one prompt as packed token rows
(:mod:`.pairs`, :mod:`.render`, :mod:`.packing`, :mod:`.check`,
:mod:`.dataset`; docs/preference-rows.md), and the losses over their per-sequence
log-probs."""
