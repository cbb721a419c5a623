"""Where Ray meets torch.distributed: the Ray Train backend contract
(:mod:`.backend`, orchestration only), the plain functions it fans out to the
workers (:mod:`.worker`), the :class:`TrainContext` a loop gets
(:mod:`.context`), the Ray Data split by mesh (:mod:`.data_config`) and the
driver's ``ray.init`` (:mod:`.ray_start`)."""
