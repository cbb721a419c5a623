"""Benchmarks of ray_fsdp_backend against hand-written FSDP2, Ray's built-ins
and the limits.

``python -m benchmarks.run`` runs every comparison side by side and writes
``results.json`` and ``results.md``; ``python -m benchmarks.gpu`` measures
throughput on one GPU. docs/benchmarks.md shows the latest tables.
"""
