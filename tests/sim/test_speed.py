"""The simulator's shortcuts price a step exactly as building its shape does (the records of a
faster simulator must be the same, bit for bit: bench/sim_speed.py)."""

from __future__ import annotations

import random

import pytest

from minimemserve.sim import FittedStepModel, StepShape, gpu_setup
from minimemserve.sim.runner import with_costs

# A step model in the range the tiny preset measures on this CPU (seconds per feature).
CPU_COEFS = (8e-3, 5e-4, 2e-7, 2e-6, 3e-4, 2.5e-4)


def _models():
    roof = gpu_setup("llama2-13b", "h800", 8, 2)
    return {
        "roofline": roof.step_model,
        "roofline tp1": gpu_setup("llama2-13b", "h800", 2, 1).step_model,
        "roofline slower decodes": with_costs(roof, 8.0, 1.0, 0.5).step_model,
        "fitted": FittedStepModel(CPU_COEFS),
    }


@pytest.mark.parametrize("name", list(_models()))
def test_decode_and_prefill_shortcuts_equal_the_step_time_of_their_shape(name):
    model = _models()[name]
    rng = random.Random(0)
    for rows in (1, 2, 7, 64, 256):
        shapes = [tuple(rng.randrange(1, 4096) for _ in range(rows)) for _ in range(5)]
        got = model.decode_times(rows, [sum(d) for d in shapes])
        assert got == [model.step_time(StepShape((), d, rows)) for d in shapes]
        assert model.decode_time(rows, sum(shapes[0])) == got[0]
    for new, cached in ((1, 0), (17, 0), (300, 2048), (4096, 16)):
        step = model.step_time(StepShape(((cached, new),), (), 1))
        assert model.prefill_time(new, cached) == step
