"""The evaluation lab: what only evaluations use, kept out of the ``minimemserve`` package.

The jobs of ``minimemserve sim`` (:mod:`.sim_jobs`): the configurations compared on the
simulator (:mod:`.compare`), the paper's reproduction and its load sweeps (:mod:`.paper`,
:mod:`.sweep`, :mod:`.bound`), the roofline's checks and calibration (:mod:`.roofline`,
:mod:`.calibration`), the Mooncake trace studies (:mod:`.trace_replay`,
:mod:`.trace_curve`); the reports they and the bench write (:mod:`.report`); and the
benchmark harness (:mod:`.harness`: ``minimemserve bench``, its hosts, HTTP target,
profiler and transfer paths).

It imports ``minimemserve``; ``minimemserve`` never imports it at module level: the
``minimemserve sim`` and ``minimemserve bench`` commands import it inside the function that
runs their jobs, so ``import minimemserve`` loads none of it (``tests/test_package_size.py``
checks this and the package's size).
"""
