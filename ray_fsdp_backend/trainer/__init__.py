"""What ``ray-fsdp train`` runs, in three layers: the training YAML's schema
and its checks (:mod:`.schema`), the data a run reads (:mod:`.data`), and the
``train_loop_per_worker`` (:mod:`.loop`). The model it trains is
:mod:`ray_fsdp_backend.models`' decoder or a pretrained Hugging Face model.
Nothing below the command line imports it."""
