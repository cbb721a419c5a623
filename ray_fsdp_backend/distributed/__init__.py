"""Process groups and meshes (:mod:`.mesh`: the only ``init_device_mesh``),
collectives the other layers share (:mod:`.collectives`), the one gradient
clipping over sharded and plain parameters (:mod:`.clip`), per-rank seeding
(:mod:`.seeding`) and the skip-on-non-finite step (:mod:`.step_guard`)."""
