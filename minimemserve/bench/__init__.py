"""Benchmark code: workloads, the ShareGPT reader, preset checkpoints, the benchmark driver,
the cost-model profiler and the transports the transfer benchmark compares.

The engine never imports this subpackage; only the command line, ``LLM(None)`` (the tiny
preset) and the scripts under ``bench/`` do.
"""
