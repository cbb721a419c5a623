"""Numerics users call from their own loops: the chunked linear cross-entropy
and per-token log-probs that never hold the logits (:mod:`.loss`), the output
head they take (:mod:`.head`), per-sequence sums of packed rows
(:mod:`.sequences`), NF4 quantisation of a frozen base (:mod:`.quantization`,
:mod:`.nf4_shards`)."""
