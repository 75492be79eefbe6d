"""The high-level entry point: ``LLM(model_dir, config=...).generate(prompts, params)``."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .config import EngineConfig
from .deployment import DeploymentSpec
from .errors import ConfigError, InvalidRequest
from .request import RequestOutput
from .sampling import SamplingParams
from .serving import Serving


class LLM:
    """Offline generation over one deployment, run in this process: ``config`` is ``PD``,
    ``PD-CC``, ``1P1D``, ``1P1D-CC1/2/3`` (``1P1D-CC`` = CC3) or ``xPyD``. ``engine`` is their
    cluster (a ``Serving``); ``model_dir=None`` uses the tiny preset checkpoint. Other keyword
    arguments are ``EngineConfig`` fields (``num_blocks``, ``max_num_seqs``...). Given a
    whole :class:`DeploymentSpec` (any runtime) instead of ``model_dir``, it runs that (as
    :meth:`from_spec` does; the other arguments are the spec's then).

    >>> LLM(None, config="PD-CC").generate(["Hello"], SamplingParams(temperature=0.0))[0].text
    """

    def __init__(
        self,
        model_dir: str | Path | DeploymentSpec | None = None,
        *,
        config: str = "PD",
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        **engine_config: Any,
    ):
        if isinstance(model_dir, DeploymentSpec):  # a whole deployment, as from_spec takes
            if engine_config:
                raise ConfigError(
                    f"LLM(spec) takes its engine settings from the spec: {sorted(engine_config)}"
                )
            spec = model_dir
        else:
            spec = DeploymentSpec(config, model_dir, device, dtype, EngineConfig(**engine_config))
        self.spec = spec
        self.model_dir = spec.model_dir
        self.deployment = spec.deployment
        self.engine: Serving = spec.build()

    @classmethod
    def from_spec(cls, spec: DeploymentSpec) -> LLM:
        """Generation over the deployment ``spec`` describes."""
        return cls(spec)

    def close(self) -> None:
        """Release the deployment's resources (tensor-parallel worker processes)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        """The model's sentencepiece tokenizer."""
        return self.engine.tokenizer

    @property
    def pool(self):
        """The MemPool of the (first) instance; ``pools`` lists every instance's pool."""
        return self.engine.pool

    @property
    def pools(self) -> list:
        """Every instance's MemPool."""
        return self.engine.pools

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run ``prompts`` (strings or token-id lists) to completion; outputs in input order.
        All are validated before any is queued: a bad one raises and changes nothing."""
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]  # one prompt, as text or as token ids
        if not isinstance(prompts, Sequence):
            raise InvalidRequest(
                f"prompts must be text, token ids or a list of them: {prompts!r:.40}"
            )
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        checked = [self.engine.validate(prompt, p) for prompt, p in zip(prompts, plist)]
        ids = [self.engine.add_request(c, p) for c, p in zip(checked, plist)]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while len(results) < len(ids):
                for out in self.engine.step():
                    results[out.request_id] = out
                    bar.update(1)
        return [results[i] for i in ids]


def _is_token_ids(prompts) -> bool:
    """Whether ``prompts`` is one prompt given as token ids (any integer type, numpy)."""
    try:
        operator.index(prompts[0])
    except (TypeError, IndexError, KeyError):
        return False
    return True
