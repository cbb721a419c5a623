"""What a run asks for: :class:`FSDPSettings` (every field documented, every
static check run at construction), the pipeline schedules a config may name.
Pure: no torch, no Ray; nothing of the package below it."""
