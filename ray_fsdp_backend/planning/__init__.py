"""PURE decisions, torch-free and Ray-free: the node topology and the mesh
layout (:mod:`.topology`), memory estimates (:mod:`.memory`), elastic
arithmetic (:mod:`.elastic`), the expert-parallel plan (:mod:`.experts`), and
the pipeline's pure half: stages and micro-batches (:mod:`.pipeline_layout`),
each rank's stages and the bubble (:mod:`.pipeline_schedules`), what the plan
prints of a pipeline (:mod:`.pipeline_plan`, :mod:`.pipeline_traffic`).
Functions of ints and shapes, tested in milliseconds; imports only
:mod:`ray_fsdp_backend.settings`."""
