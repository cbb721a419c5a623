"""The data a run reads: the byte-level corpus or tokenized text packed into
rows (:mod:`.corpus`), SFT chat data through Ray Data (:mod:`.sft`,
:mod:`.sft_batches`)."""
