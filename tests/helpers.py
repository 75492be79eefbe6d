"""Helpers shared by engine tests."""

from __future__ import annotations

import contextlib
import os
import random
import socket

import torch

from minimemserve.attention.base import SeqSlice
from minimemserve.blocks.layout import AGGREGATED, KVLayout
from minimemserve.model import ModelConfig, build_model, load_weights

TCP_LISTEN = "0A"  # the LISTEN state in /proc/net/tcp


def hf_greedy(hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers' ``generate``, one prompt at a time, no EOS stop."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            full = hf.generate(
                ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
            )
            outs.append(full[0, len(p) :].tolist())
    return outs


def our_model(model_dir) -> tuple[ModelConfig, torch.nn.Module]:
    """A checkpoint's config and our model of its family with its weights, fp32, eval mode."""
    cfg = ModelConfig.from_hf(model_dir)
    model = build_model(cfg)
    model.load_hf_weights(load_weights(model_dir, cfg))
    return cfg, model.eval()


def assert_pool_clean(pool) -> None:
    """Accounting balances and no block is still held by a request."""
    pool.check()
    for tier, s in pool.stats().items():
        if isinstance(s, dict) and "referenced" in s:
            assert s["referenced"] == 0, f"{tier}: {s['referenced']} blocks still referenced"


def sharegpt_user_turns(
    model_dir, num_sessions: int, num_turns: int, max_user_tokens: int
) -> list[list[list[int]]]:
    """User messages of real multi-turn ShareGPT conversations, as token ids.

    ``num_sessions`` conversations with at least ``num_turns`` human turns; each message is
    cut to ``max_user_tokens`` tokens so the chained prompts fit a tiny test context.
    """
    from minimemserve.model.tokenizer import Tokenizer
    from minimemserve.sharegpt import iter_sharegpt

    tok = Tokenizer.from_dir(model_dir)
    sessions = []
    for conv in iter_sharegpt():
        human = [m["value"] for m in conv["conversations"] if m.get("from") == "human"]
        human = [h for h in human if h.strip()]
        if len(human) < num_turns:
            continue
        turns = [
            tok.encode(h, add_bos=(k == 0))[:max_user_tokens]
            for k, h in enumerate(human[:num_turns])
        ]
        sessions.append(turns)
        if len(sessions) == num_sessions:
            return sessions
    raise AssertionError("not enough multi-turn ShareGPT conversations")


def attention_step(layout: KVLayout, contexts, news, seed):
    """Slices (prefills first) with shuffled block tables over a pool of random KV."""
    rng = random.Random(seed)
    need = [layout.num_blocks_for(c + n) for c, n in zip(contexts, news)]
    ids = list(range(1, 2 * sum(need) + 2))
    rng.shuffle(ids)
    slices, i = [], 0
    for c, n, b in zip(contexts, news, need):
        slices.append(SeqSlice(ids[i : i + b], c, n))
        i += b
    return slices, len(ids) + 1


def attention_reference(pool, layout, layer, slices, q, k, v, scale):
    """Store K/V by slot, then per token softmax over its visible positions, in fp32."""
    pool = pool.clone()
    view = pool[:, layer] if layout.kind == AGGREGATED else pool[layer].transpose(0, 1)
    bs, t, outs = layout.block_size, 0, []
    for s in slices:
        for j in range(s.num_new):
            p = s.num_computed + j
            view[s.block_table[p // bs], 0, p % bs] = k[t + j]
            view[s.block_table[p // bs], 1, p % bs] = v[t + j]
        for j in range(s.num_new):
            n = s.num_computed + j + 1
            rows = [view[s.block_table[p // bs], :, p % bs] for p in range(n)]
            kv = torch.stack(rows).float()  # [n, 2, KV, D]
            group = q.shape[1] // kv.shape[2]
            kk = kv[:, 0].repeat_interleave(group, 1)  # [n, H, D]
            vv = kv[:, 1].repeat_interleave(group, 1)
            w = (torch.einsum("hd,nhd->hn", q[t + j].float(), kk) * scale).softmax(-1)
            outs.append(torch.einsum("hn,nhd->hd", w, vv))
        t += s.num_new
    return torch.stack(outs), pool


def listening(pid: int) -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # an fd closed while we look
            inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[")[:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        for row in rows:
            if row[3] == TCP_LISTEN and row[9] in inodes:
                addr, port = row[1].split(":")
                raw = bytes.fromhex(addr)  # /proc prints each 32-bit word in host order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
                out.add((socket.inet_ntop(family, words), int(port, 16)))
    return out
