"""Multi-turn workloads and their results: the sessions a run replays
(:mod:`~minimemserve.workloads.sessions`) and what it measured
(:mod:`~minimemserve.workloads.results`). Real runs (``minimemserve bench``) and simulated
ones (``minimemserve sim``) both build on it; the engine and runtimes never import it.
"""
