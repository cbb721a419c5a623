"""Step metrics: :mod:`.flops` is the pure arithmetic (FLOPs per token, peak
FLOP/s, MFU, the progress line); :mod:`.reporting` measures a running loop
(:class:`StepMeter`) and reports it (TensorBoard, Ray's report lines)."""
