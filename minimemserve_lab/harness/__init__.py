"""The benchmark harness the ``bench/`` scripts run: the benchmark driver (``minimemserve
bench``), the multi-host launcher and the HTTP client it replays through, the cost-model
profiler and the transfer paths the transfer benchmark compares (:mod:`.transfer_paths`).

The top of the lab's layer stack: ``minimemserve``'s command line imports it only inside
the function that runs ``minimemserve bench`` (``tests/test_imports.py`` checks it); the
scripts under ``bench/`` import it directly.
"""
