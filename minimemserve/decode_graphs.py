"""CUDA graphs for decode steps: one captured forward per batch bucket, replayed per step.

A decode step launches ~10 kernels per layer; issued one by one from Python, their host time
(~10 us each) exceeds a 7B model's GPU time at small batches. So at engine start the decode
forward (model, logits) is captured once per bucket of ``graph_buckets`` over static input
buffers: token ids, positions, slots, sequence lengths and block tables, uploaded by one copy
of a pinned host mirror. A step of ``n`` decodes pads to the next bucket ``b >= n`` (padding
rows: slot -1, so no K/V is stored, and length 0, so attention returns zeros) and replays
that bucket's graph. The backend fixes its launch plan per bucket for the longest context
the model allows (``plan_graph``), so one capture serves every context. Steps with a prefill
and batches beyond the largest bucket run eagerly; so does everything off CUDA.

Off CUDA there is nothing to capture; ``DecodeGraphs(..., capture=False)`` then runs the same
static buffers, padding and metadata through the eager forward in place of a replay, which is
how the CPU tests check the padding path. Under tensor parallelism every rank holds its own
``DecodeGraphs`` with the same buckets and replays its own graph (the collectives are
captured in it)."""

from __future__ import annotations

import dataclasses

import torch

from .attention.base import AttentionMetadata, SeqSlice, build_metadata

# Batch buckets: small ones exactly, then steps of 8 to 64 and of 16 to 256 (vLLM's shape).
GRAPH_BATCHES = (1, 2, 4, *range(8, 64, 8), *range(64, 257, 16))
MAX_GRAPH_BATCH = GRAPH_BATCHES[-1]
ALIGN_INTS = 4  # each int32 field starts at a 16-byte boundary (Triton's pointer alignment)
# The estimate of graph memory for pool sizing: activations of one layer of the largest
# bucket, ACTIVATION_COPIES times over (q/k/v, gate/up, norms and residual live at once),
# plus the static buffers and logits, plus a fixed margin for cuBLAS workspaces.
ACTIVATION_COPIES = 4
GRAPH_MARGIN_BYTES = 256 << 20


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """The buckets up to ``min(max_batch, MAX_GRAPH_BATCH)``: ``GRAPH_BATCHES`` below it, then
    the cap itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    cap = min(max_batch, MAX_GRAPH_BATCH)
    return (*(b for b in GRAPH_BATCHES if b < cap), cap)


def graph_memory_bytes(cfg, max_batch: int, max_model_len: int, block_size: int, itemsize: int):
    """An upper estimate of the device memory the decode graphs of a model with config
    ``cfg`` take (static inputs, logits, the activations of the largest bucket): what the
    KV pool's sizing leaves free for them."""
    b = graph_buckets(max_batch)[-1]
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    per_row = 3 * cfg.hidden_size + qkv + 3 * cfg.intermediate_size
    activations = ACTIVATION_COPIES * b * per_row * itemsize
    inputs = b * (3 * 8 + 3 * 4 + 4 * -(-max_model_len // block_size))
    logits = b * cfg.vocab_size * (4 + itemsize)
    return activations + inputs + logits + GRAPH_MARGIN_BYTES


@dataclasses.dataclass
class StaticInputs:
    """The static input buffers of the graphs (device) or their pinned mirror (host): one
    int64 tensor, sliced into the fields a step fills; the block table comes last, so a step
    of ``n`` rows uploads the prefix ``[:upload_size(n)]``."""

    packed: torch.Tensor  # int64
    ids: torch.Tensor  # int64 [cap]
    positions: torch.Tensor  # int64 [cap]
    slots: torch.Tensor  # int64 [cap]; -1 for a padding row (nothing stored)
    seq_lens: torch.Tensor  # int32 [cap]; 0 for a padding row (nothing attended)
    context_lens: torch.Tensor  # int32 [cap]
    query_start_loc: torch.Tensor  # int32 [cap + 1]: 0, 1, 2, ...
    block_tables: torch.Tensor  # int32 [cap, max_blocks]
    table_end: int  # int32 offset (past the int64 fields) of the table's start

    @classmethod
    def allocate(cls, cap: int, max_blocks: int, device, pin: bool) -> StaticInputs:
        """Buffers for ``cap`` padding rows of ``max_blocks`` blocks each."""
        spans, start = [], 0
        for n in (cap, cap, cap + 1, cap * max_blocks):  # the int32 fields, aligned
            spans.append((start, n))
            start += -(-n // ALIGN_INTS) * ALIGN_INTS
        host = torch.zeros(3 * cap + start // 2, dtype=torch.int64, pin_memory=pin)
        host[2 * cap : 3 * cap] = -1
        host[3 * cap :].view(torch.int32)[spans[2][0] : spans[2][0] + cap + 1] = torch.arange(
            cap + 1, dtype=torch.int32
        )
        packed = host.to(device)
        ints = packed[3 * cap :].view(torch.int32)
        seq, ctx, qsl, table = (ints[a : a + n] for a, n in spans)
        return cls(
            packed,
            packed[:cap],
            packed[cap : 2 * cap],
            packed[2 * cap : 3 * cap],
            seq,
            ctx,
            qsl,
            table.view(cap, max_blocks),
            spans[3][0],
        )

    def upload_size(self, rows: int) -> int:
        """int64 elements of ``packed`` that hold the first ``rows`` rows of every field."""
        ints = self.table_end + rows * self.block_tables.shape[1]
        return 3 * self.ids.shape[0] + -(-ints // 2)


class DecodeGraphs:
    """Decode forwards of ``model`` over ``backend``, one per bucket of ``graph_buckets``,
    each captured as a CUDA graph (``capture=True``, CUDA only) or run eagerly on the same
    static buffers (``capture=False``). ``run`` serves a step, or returns None for a step it
    does not serve."""

    def __init__(self, model, backend, max_batch: int, max_model_len: int, capture: bool):
        if not hasattr(backend, "plan_graph"):
            raise ValueError(f"the {backend.name} backend cannot plan a graph's launches")
        if capture and backend.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {backend.device}")
        self.model = model
        self.backend = backend
        self.buckets = graph_buckets(max_batch)
        self.max_model_len = max_model_len
        self.block_size = backend.layout.block_size
        cap = self.buckets[-1]
        max_blocks = -(-max_model_len // self.block_size)
        device = backend.device
        self.host = StaticInputs.allocate(cap, max_blocks, "cpu", pin=device.type == "cuda")
        self.static = StaticInputs.allocate(cap, max_blocks, device, pin=False)
        self.logits: torch.Tensor | None = None  # fp32 [cap, vocab], set by the first forward
        self.metadata = {b: self._metadata(b) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.memory_bytes = 0  # device memory the captures took (measured)
        if capture:
            self._capture()

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` rows, or None beyond the largest."""
        return next((b for b in self.buckets if b >= n), None)

    def run(self, slices: list[SeqSlice], ids: list[int]) -> torch.Tensor | None:
        """fp32 logits ``[n, vocab]`` of a step of ``n`` single-token slices (``ids`` their
        tokens), from the bucket's graph; None for a step with a prefill or too many rows."""
        b = self.bucket(len(slices))
        if b is None or any(s.num_new != 1 for s in slices):
            return None
        n = len(slices)
        md = build_metadata(slices, self.block_size, "cpu")  # validates; vectorised
        if md.max_seq_len > self.max_model_len:
            raise ValueError(f"a sequence of {md.max_seq_len} tokens exceeds the graphs' limit")
        h = self.host
        h.ids[:n] = torch.tensor(ids)
        h.ids[n:b] = 0
        h.positions[:n] = md.positions
        h.positions[n:b] = 0
        h.slots[:n] = md.slot_mapping
        h.slots[n:b] = -1  # padding rows store nothing
        h.seq_lens[:n] = md.seq_lens
        h.seq_lens[n:b] = 0  # and attend to nothing
        h.context_lens[:n] = md.context_lens
        h.context_lens[n:b] = 0
        width = min(md.block_tables.shape[1], h.block_tables.shape[1])  # blocks past the
        h.block_tables[:n, :width] = md.block_tables[:, :width]  # limit are never read
        size = h.upload_size(n)
        self.static.packed[:size].copy_(h.packed[:size], non_blocking=True)
        self._replay(b)
        return self.logits[:n]

    def _metadata(self, b: int) -> AttentionMetadata:
        """The static metadata of bucket ``b``: views of the static buffers, planned by the
        backend for contexts up to ``max_model_len``. Its host lists describe that plan (the
        longest sequence), not a step."""
        s = self.static
        md = AttentionMetadata(
            positions=s.positions[:b],
            slot_mapping=s.slots[:b],
            query_start_loc=s.query_start_loc[: b + 1],
            context_lens=s.context_lens[:b],
            seq_lens=s.seq_lens[:b],
            block_tables=s.block_tables[:b],
            num_prefills=0,
            num_prefill_tokens=0,
            num_decodes=b,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_host=[1] * b,
            context_lens_host=[self.max_model_len - 1] * b,
            seq_lens_host=[self.max_model_len] * b,
            block_size=self.block_size,
        )
        return self.backend.plan_graph(md)

    def _forward(self, b: int) -> None:
        """The decode forward of bucket ``b`` over the static buffers, logits into place."""
        hidden = self.model(self.static.ids[:b], self.backend, self.metadata[b])  # [b, hidden]
        logits = self.model.compute_logits(hidden)  # [b, vocab] (all of it, under TP too)
        if self.logits is None:  # the first forward runs eagerly, before any capture
            shape = (self.buckets[-1], logits.shape[1])
            self.logits = torch.empty(shape, dtype=logits.dtype, device=logits.device)
        self.logits[:b].copy_(logits)

    def _replay(self, b: int) -> None:
        graph = self.graphs.get(b)
        if graph is None:  # not captured (off CUDA): the eager forward stands in
            self._forward(b)
        else:
            graph.replay()

    @torch.inference_mode()
    def _capture(self) -> None:
        """Capture every bucket, largest first, all in one memory pool (a smaller graph
        reuses the larger one's activation memory); each warmed up eagerly first (Triton
        compiles, cuBLAS picks its kernels)."""
        device = self.backend.device
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = None
        for b in reversed(self.buckets):
            self._forward(b)  # warm-up over the static buffers (every row is padding)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(b)
            except RuntimeError as e:
                raise RuntimeError(
                    f"capturing the decode graph of batch {b} failed ({e}); "
                    "enforce_eager=True runs every step without graphs"
                ) from e
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(device)
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])


def run_step(model, backend, graphs: DecodeGraphs | None, slices, ids, rows, device):
    """fp32 logits ``[len(rows), vocab]`` of the new tokens at ``rows`` of a step (None when
    there are none): from a graph when ``graphs`` serves the step, else an eager forward."""
    logits = None if graphs is None else graphs.run(slices, ids)  # [n, vocab]: every row
    if logits is not None:
        return logits if len(rows) == len(ids) else logits[torch.tensor(rows, device=device)]
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)  # [T]
    hidden = model(input_ids, backend, backend.prepare(slices))  # [T, hidden]
    if not rows:
        return None
    return model.compute_logits(hidden[torch.tensor(rows, device=device)])  # [B, vocab] fp32
