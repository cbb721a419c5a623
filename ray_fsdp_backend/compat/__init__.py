"""The one place that knows third-party internals: transformers
(:mod:`.transformers`, :mod:`.transformers_moe`), peft's model anatomy
(:mod:`.peft`), and which optional extra to install (:mod:`.optional_imports`).
A library upgrade that moves a private name is fixed here, nowhere else."""
