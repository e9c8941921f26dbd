"""Benchmarks: random-weight checkpoints of public model shapes (``synth``) and
stock-vs-edge0 timings, each run in a fresh process (``runner``)."""
