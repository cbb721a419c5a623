"""The training YAML: its sections as dataclasses (:mod:`.options`,
:mod:`.pretrained`), the whole document (:mod:`.spec`), the rules that span
sections (:mod:`.rules`) and the checks of storage and data run before any
worker starts (:mod:`.preflight`). Starts no torch where the answer needs none."""
