"""The high-level entry point: ``LLM(model_dir, config=...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .bench.presets import preset_dir
from .config import EngineConfig, parse_config_name
from .disagg.cluster import InProcessCluster
from .request import RequestOutput
from .sampling import SamplingParams
from .serving import Serving


class LLM:
    """Offline generation over one configuration.

    ``config`` names the deployment: ``PD`` / ``PD-CC`` run one colocated engine;
    ``1P1D``, ``1P1D-CC1/2/3`` (``1P1D-CC`` = CC3) and ``xPyD`` forms run prefill and decode
    instances in this process, moving KV through MemPool's transfer calls. ``engine`` is the
    in-process cluster of them all (a ``minimemserve.serving.Serving``). With
    ``model_dir=None`` the tiny preset checkpoint is written (once, cached) and used.

    >>> llm = LLM(None, config="PD-CC")
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    >>> out.token_ids, out.text, out.metrics.ttft
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        config: str = "PD",
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        dram_blocks: int = 0,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        attention: str | None = None,
        seed: int = 0,
    ):
        if model_dir is None:
            model_dir = preset_dir("tiny")
        self.model_dir = Path(model_dir)
        self.deployment = parse_config_name(config)
        ecfg = EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            kv_memory_bytes=kv_memory_bytes,
            dram_blocks=dram_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            attention=attention,
            seed=seed,
        )
        self.engine: Serving = InProcessCluster(
            self.model_dir, self.deployment, device=device, dtype=dtype, engine_config=ecfg
        )

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

        Every prompt is validated before any is queued, so a bad one raises (a
        ``ValueError`` subclass, or ``PoolExhausted``) and leaves the engine as it was.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or as token ids
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        for prompt, p in zip(prompts, plist):
            self.engine.validate(prompt, p)
        ids = [self.engine.add_request(prompt, p) for prompt, p in zip(prompts, plist)]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while len(results) < len(ids):
                for out in self.engine.step():
                    results[out.request_id] = out
                    bar.update(1)
        return [results[i] for i in ids]
