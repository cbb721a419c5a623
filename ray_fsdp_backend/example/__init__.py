"""The example that ``ray-fsdp train`` runs: a Llama-style decoder (``model``),
byte-level data sharded by rank (``data``), the training-YAML schema
(``spec``) and the ``train_loop_per_worker`` (``train``)."""
