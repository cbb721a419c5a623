"""Numerics users call from their own loops: the chunked linear cross-entropy
that never holds the logits (:mod:`.loss`), NF4 quantisation of a frozen base
(:mod:`.quantization`, :mod:`.nf4_shards`)."""
