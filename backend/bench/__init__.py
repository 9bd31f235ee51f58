"""Engine benchmark: ``python -m backend.bench [--quick] [--json FILE] [--device cpu|cuda]``.

Every figure is a ratio measured side by side in one run (continuous vs static batching
on the same engine, vs ``transformers`` generate, decode step vs a roofline measured on
this machine, prefix cache on vs off). docs/bench.md explains the workload and baselines.
"""
