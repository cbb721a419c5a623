"""The ``train_loop_per_worker`` (:mod:`.train`) and its parts: building the
model (:mod:`.pretrained`, :mod:`.lora`) and the optimizer (:mod:`.optim`),
one step (:mod:`.step`, :mod:`.loss`, :mod:`.pipeline`) and the held-out loss
(:mod:`.evaluation`)."""
