"""The elementwise work of a decoder layer, as a backend offers it to the model.

Every attention backend has an ``elementwise`` object with three calls the model makes:
``add_rmsnorm`` (the residual add and the norm after it), ``rope_attend`` (rotary, K/V
store and attention) and ``silu_mul`` (SwiGLU's gate). ``TorchElementwise`` runs them as
separate PyTorch ops in exactly HF's order of roundings: the reference, and the CPU path.
The Triton backend's version fuses each into one kernel (``triton_backend``), so a decode
layer launches 3 elementwise kernels instead of about 30."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchElementwise:
    """The unfused ops: HF's arithmetic, op by op."""

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(s), s)`` for ``s = x + residual`` (``x`` alone without a residual);
        ``norm`` is the model's RMSNorm module."""
        s = x if residual is None else x + residual  # [T, hidden]
        return norm(s), s

    def rope_attend(self, backend, q, k, v, rotary, positions, layer_id: int, md):
        """Rotate ``q``/``k`` at ``positions`` with the model's ``rotary``, then let
        ``backend`` store K/V of ``layer_id`` and attend."""
        q, k = rotary(q, k, positions)
        return backend.forward(q, k, v, layer_id, md)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` ``[T, 2 * inter]`` (gate first)."""
        gate, up = gate_up.chunk(2, dim=-1)  # [T, inter] each
        return F.silu(gate) * up


TORCH_ELEMENTWISE = TorchElementwise()
