"""The benchmark harness the ``bench/`` scripts run: the benchmark driver (``minimemserve
bench``), the multi-host launcher and the HTTP client it replays through, the cost-model
profiler and the transfer paths the transfer benchmark compares (:mod:`.transfer_paths`).

The top of the package's layer stack below the command line: nothing else in the package
imports it (``tests/test_imports.py`` checks it); the scripts under ``bench/`` do.
"""
