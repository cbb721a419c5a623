"""The trainer behind ``ray-fsdp train``: the training-YAML schema (``spec``),
a Llama-style decoder (``model``) or a pretrained Hugging Face model
(``pretrained``), byte-level or tokenized data sharded by data-parallel rank
(``data``), and the ``train_loop_per_worker`` (``train``)."""
