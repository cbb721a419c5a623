"""``ray-fsdp train / plan / validate`` (:mod:`.main`) and what ``plan`` prints
(:mod:`.plan_report`, :mod:`.plan_estimates`). The top of the package: nothing
imports it."""
