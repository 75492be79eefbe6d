"""A compressed radix tree over token ids at block granularity, in plain Python.

A node holds a token run of whole blocks (``array('q')``; passing one skips a conversion
of about 10 ns per token) and one int value per block: block ids in MemPool's index,
placeholders in the global scheduler's prompt trees (whose entries expire after a TTL).
Children are keyed by their first block's bytes: an edge costs a dict lookup and a memcmp."""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

TOKEN_TYPECODE = "q"  # int64 tokens: any vocabulary fits, and slices compare with memcmp


def as_tokens(tokens: Sequence[int]) -> array:
    """``tokens`` as an ``array('q')``; returned as is when it already is one."""
    if isinstance(tokens, array) and tokens.typecode == TOKEN_TYPECODE:
        return tokens
    try:
        return array(TOKEN_TYPECODE, tokens)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"tokens must be a sequence of int64 token ids: {e}") from None


class RadixNode:
    """One edge: a token run, one value per block, and metadata (last access, expiry time or
    None, tier, holder). ``key`` is the first block's bytes, its key in ``parent.children``."""

    __slots__ = ("key", "tokens", "values", "children", "parent")
    __slots__ += ("last_access", "expires_at", "tier", "holder")

    def __init__(self, key: bytes, tokens: array, values: list, parent: RadixNode | None) -> None:
        self.key = key
        self.tokens = tokens
        self.values = values
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.last_access = 0.0
        self.expires_at = None  # expires_at: None for never
        self.tier = self.holder = None  # str | None, as the owner sets them

    def __repr__(self) -> str:
        blocks, kids, t = len(self.values), len(self.children), self.last_access
        return f"RadixNode(blocks={blocks}, children={kids}, tier={self.tier!r}, last_access={t})"


class Match(NamedTuple):
    """What ``match_prefix`` found: the walked nodes (the last perhaps in part), the values."""

    num_tokens: int
    values: list[int]
    nodes: list[RadixNode]


class RadixTree:
    """Token prefixes to per-block values. ``clock`` gives the time when a call passes no
    ``now``; ``node_type`` is the class of every node (it may carry the owner's state)."""

    def __init__(
        self,
        block_size: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        node_type: type[RadixNode] = RadixNode,
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self._clock = clock
        self._node = node_type
        self.root = node_type(b"", array(TOKEN_TYPECODE), [], None)
        self.num_blocks = self.num_nodes = 0  # values in the whole tree; nodes but the root

    def match_prefix(
        self, tokens: Sequence[int], *, now: float | None = None, touch: bool = True
    ) -> Match:
        """Longest stored prefix of ``tokens`` in whole blocks, touching the walked nodes
        unless ``touch`` is False. An expired node met on the way is removed."""
        tokens, bs = as_tokens(tokens), self.block_size
        end = len(tokens) - len(tokens) % bs
        now = self._clock() if now is None else now
        node, pos = self.root, 0
        values: list[int] = []
        nodes: list[RadixNode] = []
        while pos < end:
            child = node.children.get(tokens[pos : pos + bs].tobytes())
            if child is None:
                break
            if child.expires_at is not None and child.expires_at <= now:
                self.remove(child)
                break
            nodes.append(child)
            stop = pos + len(child.tokens)
            if stop <= end and tokens[pos:stop] == child.tokens:
                values += child.values
                node, pos = child, stop
                continue
            k = self._common_blocks(child, tokens, pos, end)
            values += child.values[:k]
            pos += k * bs
            break
        if touch:
            for n in nodes:
                n.last_access = now
        return Match(pos, values, nodes)

    def _common_blocks(self, node: RadixNode, tokens: array, pos: int, end: int) -> int:
        """Whole blocks ``node.tokens`` shares with ``tokens[pos:end]`` (its first block does)."""
        bs = self.block_size
        lo, hi = 1, min(len(node.tokens), end - pos) // bs
        while lo < hi:  # the shared prefix is monotone in length: binary search
            mid = (lo + hi + 1) // 2
            if node.tokens[: mid * bs] == tokens[pos : pos + mid * bs]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def insert(
        self,
        tokens: Sequence[int],
        values: Sequence[int],
        *,
        now: float | None = None,
        ttl: float | None = None,
        tier: str | None = None,
        holder: str | None = None,
    ) -> int:
        """Store ``tokens`` (whole blocks) with one value per block; return how many leading
        blocks were stored already (they keep their values, tier and holder). The path is
        touched and, with a ``ttl``, expires no earlier than ``now + ttl``."""
        tokens = as_tokens(tokens)
        bs, end = self.block_size, len(tokens)
        if end % bs:
            raise ValueError(f"insert takes whole blocks: {end} tokens is not a multiple of {bs}")
        if len(values) != end // bs:
            raise ValueError(f"{end} tokens are {end // bs} blocks but {len(values)} values given")
        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        now = self._clock() if now is None else now
        expires_at = None if ttl is None else now + ttl
        node, pos = self.root, 0
        while pos < end:
            key = tokens[pos : pos + bs].tobytes()
            child = node.children.get(key)
            if child is not None and child.expires_at is not None and child.expires_at <= now:
                self.remove(child)
                child = None
            if child is None:
                vals = list(values[pos // bs :])
                new = node.children[key] = self._node(key, tokens[pos:], vals, node)
                new.last_access, new.expires_at = now, expires_at
                new.tier, new.holder = tier, holder
                self.num_nodes += 1
                self.num_blocks += len(vals)
                return pos // bs
            stop = pos + len(child.tokens)
            if stop > end or tokens[pos:stop] != child.tokens:
                k = self._common_blocks(child, tokens, pos, end)
                if k < len(child.values):
                    child = self.split(child, k)
            child.last_access = now
            if expires_at is not None and child.expires_at is not None:
                child.expires_at = max(child.expires_at, expires_at)
            pos += len(child.tokens)
            node = child
        return pos // bs

    def split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut ``node`` after ``num_blocks`` blocks; return the new head, a copy of its
        metadata. ``node`` keeps the tail and its children and becomes the head's child."""
        if node is self.root or not 0 < num_blocks < len(node.values):
            raise ValueError(f"cannot split a node of {len(node.values)} blocks after {num_blocks}")
        cut, parent = num_blocks * self.block_size, node.parent
        head = self._node(node.key, node.tokens[:cut], node.values[:num_blocks], parent)
        head.last_access, head.expires_at = node.last_access, node.expires_at
        head.tier, head.holder = node.tier, node.holder
        parent.children[node.key] = head
        node.tokens, node.values = node.tokens[cut:], node.values[num_blocks:]
        node.key = node.tokens[: self.block_size].tobytes()
        node.parent = head
        head.children[node.key] = node
        self.num_nodes += 1
        return head

    def truncate(self, node: RadixNode, num_blocks: int) -> list[tuple[RadixNode, list[int]]]:
        """Drop the last ``num_blocks`` blocks of ``node`` and all its descendants; return the
        values grouped by node, ``node`` first (it stays while it has blocks left)."""
        if node is self.root or not 0 < num_blocks <= len(node.values):
            raise ValueError(f"cannot drop {num_blocks} blocks of a node of {len(node.values)}")
        if num_blocks == len(node.values):
            return self.remove(node)
        dropped = [d for child in list(node.children.values()) for d in self.remove(child)]
        keep = len(node.values) - num_blocks
        tail = node.values[keep:]
        node.values, node.tokens = node.values[:keep], node.tokens[: keep * self.block_size]
        self.num_blocks -= num_blocks
        return [(node, tail), *dropped]

    def remove(self, node: RadixNode) -> list[tuple[RadixNode, list[int]]]:
        """Remove ``node`` and its subtree; return their values grouped by node (preorder)."""
        parent = node.parent
        if parent is None or parent.children.get(node.key) is not node:
            raise ValueError("cannot remove the root or a node not in this tree")
        del parent.children[node.key]
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append((n, n.values))
            stack.extend(n.children.values())
            n.parent = None
        self.num_nodes -= len(out)
        self.num_blocks -= sum(len(v) for _, v in out)
        return out

    def expire(self, now: float | None = None) -> list[tuple[RadixNode, list[int]]]:
        """Remove every node whose expiry time has passed, with its subtree."""
        now = self._clock() if now is None else now
        dropped: list[tuple[RadixNode, list[int]]] = []
        stack = [self.root]
        while stack:
            for child in list(stack.pop().children.values()):
                if child.expires_at is not None and child.expires_at <= now:
                    dropped += self.remove(child)
                else:
                    stack.append(child)
        return dropped

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
