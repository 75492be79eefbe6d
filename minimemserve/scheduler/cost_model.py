"""The operator-level prefill cost model the global scheduler routes with.

``exec(x, y)`` predicts one prefill step of ``x`` prompt tokens whose first ``x*y`` are
cached, as the sum of three fitted parts (linear layers, prefix attention, everything
else; see :class:`CostModel`); ``transfer(n)`` predicts moving ``n`` tokens' KV between
instances. The coefficients are least-squares fits to measurements of this engine on this
device (:mod:`minimemserve_lab.harness.profile` takes them; ``bench/cost_model.py`` fits them)."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_PART_NAMES = ("linear", "attention", "other")
_FORMAT = "minimemserve.cost_model/1"
# coefficient field -> how many coefficients its formula has
_NUM_COEFS = {"linear": 2, "attention": 4, "other": 2, "transfer_coef": 2}


def _check_count(what: str, x: Any) -> int:
    """``x`` as a non-negative int, or a ValueError naming ``what``."""
    try:
        if isinstance(x, bool):
            raise TypeError
        x = operator.index(x)
    except TypeError:
        raise ValueError(f"{what} must be an int, got {x!r}") from None
    if x < 0:
        raise ValueError(f"{what} must be >= 0, got {x}")
    return x


def _check_xy(x: Any, y: Any) -> tuple[int, float]:
    """The prompt length ``x`` and cached fraction ``y`` checked, as an int and a float."""
    x = _check_count("prompt length x", x)
    if isinstance(y, bool) or not isinstance(y, numbers.Real):
        raise ValueError(f"cached fraction y must be a number in [0, 1], got {y!r}")
    if not 0.0 <= (y := float(y)) <= 1.0:  # also rejects NaN
        raise ValueError(f"cached fraction y must be in [0, 1], got {y}")
    return x, y


@dataclass(frozen=True)
class OpSample:
    """One measured prefill step: ``x`` prompt tokens, a fraction ``y`` of them cached, and
    seconds in linear layers, attention, everything else, and the whole step."""

    x: int
    y: float
    linear_s: float
    attention_s: float
    other_s: float
    total_s: float

    def __post_init__(self) -> None:
        x, y = _check_xy(self.x, self.y)
        object.__setattr__(self, "x", x)
        object.__setattr__(self, "y", y)
        for name in ("linear_s", "attention_s", "other_s", "total_s"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ValueError(f"OpSample.{name} must be a finite number, got {v!r}")

    @property
    def new_tokens(self) -> int:
        """Tokens the step computed (``x`` less the cached prefix)."""
        return self.x - round(self.x * self.y)


def _lstsq(rows: list[list[float]], targets: list[float]) -> tuple[float, ...]:
    """Least-squares ``c`` of ``rows @ c ≈ targets`` (minimum norm when underdetermined).
    Columns are scaled to unit norm first: ``x²`` and ``1`` are six orders of magnitude apart."""
    a = torch.tensor(rows, dtype=torch.float64)  # [S, K]
    b = torch.tensor(targets, dtype=torch.float64)[:, None]  # [S, 1]
    norms = a.norm(dim=0)  # [K]
    norms = torch.where(norms > 0, norms, torch.ones_like(norms))  # an all-zero column stays 0
    sol = torch.linalg.lstsq(a / norms, b, driver="gelsd").solution[:, 0]  # [K]
    return tuple((sol / norms).tolist())


def _fit_transfer(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    pairs = [(float(b), float(s)) for b, s in samples]
    if not pairs:
        return (0.0, 0.0)
    if any(b < 0 or s < 0 or not math.isfinite(b + s) for b, s in pairs):
        raise ValueError(f"transfer samples must be (bytes >= 0, seconds >= 0), got {pairs}")
    if len({b for b, _ in pairs}) == 1:  # one size: a bandwidth through the origin
        bb = sum(b * b for b, _ in pairs)
        return (sum(b * s for b, s in pairs) / bb if bb else 0.0, 0.0)
    a, b = _lstsq([[b, 1.0] for b, _ in pairs], [s for _, s in pairs])
    return (a, b)


@dataclass(frozen=True)
class CostModel:
    """Predicted prefill time ``exec(x, y)`` per operator and KV ``transfer(n)``, in seconds; parts
    are clamped at zero, so a negative fitted intercept never predicts negative time."""

    linear: tuple[float, float]  # qkv, o, gate_up, down, lm_head: a*n + b, n = new tokens
    attention: tuple[float, float, float, float]  # prefix attention: a*x²*y + b*x² + c*x + d
    other: tuple[float, float]  # norms, rotary, activations, embedding, step overhead: a*n + b
    transfer_coef: tuple[float, float] = (0.0, 0.0)  # seconds = a*bytes + b
    kv_bytes_per_token: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name, size in _NUM_COEFS.items():
            value = getattr(self, name)
            try:
                coefs = tuple(float(v) for v in value)
            except (TypeError, ValueError):
                coefs = ()
            if len(coefs) != size or not all(math.isfinite(v) for v in coefs):
                raise ValueError(f"CostModel.{name} must be {size} finite numbers, got {value!r}")
            object.__setattr__(self, name, coefs)
        kv = _check_count("CostModel.kv_bytes_per_token", self.kv_bytes_per_token)
        object.__setattr__(self, "kv_bytes_per_token", kv)
        if not isinstance(self.device, str):
            raise ValueError(f"CostModel.device must be a string, got {self.device!r}")

    def parts(self, x: int, y: float) -> dict[str, float]:
        """Predicted seconds per operator class: ``{"linear", "attention", "other"}``."""
        x, y = _check_xy(x, y)
        if x == 0:
            return dict.fromkeys(_PART_NAMES, 0.0)
        n = x - round(x * y)
        (la, lb), (aa, ab, ac, ad), (oa, ob) = self.linear, self.attention, self.other
        return {
            "linear": max(0.0, la * n + lb),
            "attention": max(0.0, aa * x * x * y + ab * x * x + ac * x + ad),
            "other": max(0.0, oa * n + ob),
        }

    def exec(self, x: int, y: float) -> float:
        """Predicted seconds of the prefill step of ``x`` tokens with a fraction ``y`` cached."""
        return sum(self.parts(x, y).values())

    def decode(self, x: int) -> float:
        """Predicted seconds one more sequence of ``x`` tokens adds to a decode step: its token's
        linear and other slopes and its attention over ``x`` tokens (no step intercepts)."""
        x = _check_count("sequence length x", x)
        (la, _), (aa, ab, ac, _), (oa, _) = self.linear, self.attention, self.other
        return max(0.0, la + oa + aa * x * (x - 1) + ab * x * x + ac * x)

    def transfer(self, num_tokens: int) -> float:
        """Predicted seconds to move ``num_tokens`` tokens' KV to another instance."""
        n = _check_count("num_tokens", num_tokens)
        a, b = self.transfer_coef
        return max(0.0, a * n * self.kv_bytes_per_token + b) if n else 0.0

    @classmethod
    def fit(
        cls,
        samples: Sequence[OpSample],
        transfer_samples: Sequence[tuple[int, float]] = (),
        kv_bytes_per_token: int = 0,
        device: str = "cpu",
    ) -> CostModel:
        """Least-squares fit of each operator's formula to measured ``samples``.
        ``transfer_samples`` are ``(bytes, seconds)`` pairs; with one message size among them the
        line goes through the origin (a bandwidth); with none, ``transfer`` predicts 0."""
        samples = list(samples)
        if not samples:
            raise ValueError("CostModel.fit needs at least one OpSample")
        for i, s in enumerate(samples):
            if not isinstance(s, OpSample):
                raise ValueError(f"sample {i} is a {type(s).__name__}, not an OpSample")
        n_rows = [[float(s.new_tokens), 1.0] for s in samples]
        attn_rows = [[s.x * s.x * s.y, float(s.x * s.x), float(s.x), 1.0] for s in samples]
        return cls(
            linear=_lstsq(n_rows, [s.linear_s for s in samples]),
            attention=_lstsq(attn_rows, [s.attention_s for s in samples]),
            other=_lstsq(n_rows, [s.other_s for s in samples]),
            transfer_coef=_fit_transfer(transfer_samples),
            kv_bytes_per_token=kv_bytes_per_token,
            device=device,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return {"format": _FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        """Inverse of :meth:`to_dict`."""
        if not isinstance(d, dict):
            raise ValueError(f"a cost model dict is needed, got {type(d).__name__}")
        if d.get("format", _FORMAT) != _FORMAT:
            raise ValueError(f"unknown cost model format {d['format']!r}; expected {_FORMAT!r}")
        if missing := [k for k in _PART_NAMES if k not in d]:
            raise ValueError(f"cost model dict lacks {', '.join(missing)}")
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def save(self, path: str | Path) -> Path:
        """Write the model as JSON to ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a model :meth:`save` wrote, or the ``"model"`` entry of a JSON object."""
        d = json.loads(Path(path).read_text())
        if isinstance(d, dict) and isinstance(d.get("model"), dict):
            d = d["model"]
        return cls.from_dict(d)
