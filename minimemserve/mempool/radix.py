"""A compressed radix tree over token ids at block granularity (plain Python).

Each node holds a run of tokens whose length is a multiple of ``block_size`` (an
``array('q')``) and one int value per block. What the values mean is the owner's
business: MemPool stores block ids; the global scheduler keeps one tree per instance and
only uses the prefixes (and their expiry). Children are keyed by the bytes of their first
block, so walking one edge costs one dict lookup and one C-level comparison of array
slices. Nodes split only at block boundaries.

Besides the values, a node carries its last access time, an optional expiry time (for
prompt trees with a TTL), the tier its blocks live in and the instance that holds them.

Token sequences are ``array('q')`` internally; passing one avoids a conversion that costs
about 10 ns per token for a list.
"""

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
    """One edge of the tree: a token run, one value per block, and metadata.

    ``tokens`` has ``len(values) * block_size`` entries. ``key`` is the bytes of the first
    block (the node's key in its parent's ``children``). ``expires_at`` is None for
    entries that never expire. The root has no tokens and no parent.
    """

    __slots__ = (
        "key",
        "tokens",
        "values",
        "children",
        "parent",
        "last_access",
        "expires_at",
        "tier",
        "holder",
    )

    def __init__(
        self,
        key: bytes,
        tokens: array,
        values: list[int],
        parent: RadixNode | None,
        last_access: float,
        expires_at: float | None = None,
        tier: str | None = None,
        holder: str | None = None,
    ) -> None:
        self.key = key
        self.tokens = tokens
        self.values = values
        self.children: dict[bytes, RadixNode] = {}
        self.parent = parent
        self.last_access = last_access
        self.expires_at = expires_at
        self.tier = tier
        self.holder = holder

    @property
    def num_blocks(self) -> int:
        """Blocks (values) on this node."""
        return len(self.values)

    def __repr__(self) -> str:
        return (
            f"RadixNode(blocks={len(self.values)}, children={len(self.children)}, "
            f"tier={self.tier!r}, last_access={self.last_access})"
        )


class Match(NamedTuple):
    """Result of ``RadixTree.match_prefix``.

    ``nodes`` are the nodes the match walked through, in order. Every node but possibly
    the last is matched in full; the last may be matched only in part. ``values`` are the
    matched blocks' values in order (``num_tokens // block_size`` of them).
    """

    num_tokens: int
    values: list[int]
    nodes: list[RadixNode]


class RadixTree:
    """Block-granular compressed radix tree mapping token prefixes to per-block values.

    ``clock`` gives the time used when a call passes no ``now`` (access times and TTLs);
    ``node_type`` is the class of every node (a subclass may carry the owner's bookkeeping).
    """

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
        self.root = node_type(b"", array(TOKEN_TYPECODE), [], None, 0.0)
        self._num_blocks = 0
        self._num_nodes = 0

    # -- queries -----------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Values (blocks) stored in the whole tree."""
        return self._num_blocks

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, the root excluded."""
        return self._num_nodes

    def match_prefix(
        self, tokens: Sequence[int], *, now: float | None = None, touch: bool = True
    ) -> Match:
        """Longest stored prefix of ``tokens`` in whole blocks.

        Touches the access time of the walked nodes unless ``touch`` is False. An expired
        node met on the way is removed with its subtree and ends the match.
        """
        tokens = as_tokens(tokens)
        bs = self.block_size
        end = len(tokens) - len(tokens) % bs
        if now is None:
            now = self._clock()
        node = self.root
        pos = 0
        values: list[int] = []
        nodes: list[RadixNode] = []
        while pos < end:
            child = node.children.get(tokens[pos : pos + bs].tobytes())
            if child is None:
                break
            if child.expires_at is not None and child.expires_at <= now:
                self.remove(child)
                break
            n = len(child.tokens)
            stop = pos + n
            if stop <= end and tokens[pos:stop] == child.tokens:
                values += child.values
                nodes.append(child)
                pos = stop
                node = child
                continue
            k = self._common_blocks(child, tokens, pos, end)
            values += child.values[:k]
            nodes.append(child)
            pos += k * bs
            break
        if touch:
            for n_ in nodes:
                n_.last_access = now
        return Match(pos, values, nodes)

    def _common_blocks(self, node: RadixNode, tokens: array, pos: int, end: int) -> int:
        """Whole blocks ``node.tokens`` shares with ``tokens[pos:end]`` (its first block does)."""
        bs = self.block_size
        lo, hi = 1, min(len(node.tokens), end - pos) // bs
        # the shared prefix is monotone in length: binary search on slice equality
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if node.tokens[: mid * bs] == tokens[pos : pos + mid * bs]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- updates -----------------------------------------------------------------------

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
        """Store ``tokens`` (a whole number of blocks) with one value per block.

        Blocks whose prefix is already stored keep their existing values; only the new
        suffix takes ``values``, ``tier`` and ``holder``. Every node on the path is touched
        and, with a ``ttl``, expires no earlier than ``now + ttl``. Returns how many leading
        blocks were already stored (``values[result:]`` were taken).
        """
        tokens = as_tokens(tokens)
        bs = self.block_size
        if len(tokens) % bs:
            raise ValueError(
                f"insert takes whole blocks: {len(tokens)} tokens is not a multiple of {bs}"
            )
        if len(values) != len(tokens) // bs:
            raise ValueError(
                f"{len(tokens)} tokens are {len(tokens) // bs} blocks but {len(values)} "
                "values were given"
            )
        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        if now is None:
            now = self._clock()
        expires_at = None if ttl is None else now + ttl
        end = len(tokens)
        node = self.root
        pos = 0
        while pos < end:
            key = tokens[pos : pos + bs].tobytes()
            child = node.children.get(key)
            if child is not None and child.expires_at is not None and child.expires_at <= now:
                self.remove(child)
                child = None
            if child is None:
                new = self._node(
                    key,
                    tokens[pos:end],
                    list(values[pos // bs :]),
                    node,
                    now,
                    expires_at,
                    tier,
                    holder,
                )
                node.children[key] = new
                self._num_nodes += 1
                self._num_blocks += len(new.values)
                return pos // bs
            n = len(child.tokens)
            if not (pos + n <= end and tokens[pos : pos + n] == child.tokens):
                k = self._common_blocks(child, tokens, pos, end)
                if k < len(child.values):
                    child = self.split(child, k)
            self._refresh(child, now, expires_at)
            pos += len(child.tokens)
            node = child
        return pos // bs

    @staticmethod
    def _refresh(node: RadixNode, now: float, expires_at: float | None) -> None:
        node.last_access = now
        if expires_at is not None and node.expires_at is not None:
            node.expires_at = max(node.expires_at, expires_at)

    def split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut ``node`` after its first ``num_blocks`` blocks; return the new head node.

        ``node`` itself keeps the tail (and its children) and becomes the head's only
        child, so references to ``node`` still reach the same blocks. Metadata is copied.
        """
        if node is self.root or not 0 < num_blocks < len(node.values):
            raise ValueError(
                f"cannot split a node of {len(node.values)} blocks after {num_blocks} blocks"
            )
        cut = num_blocks * self.block_size
        parent = node.parent
        assert parent is not None
        head = self._node(
            node.key,
            node.tokens[:cut],
            node.values[:num_blocks],
            parent,
            node.last_access,
            node.expires_at,
            node.tier,
            node.holder,
        )
        parent.children[node.key] = head
        node.tokens = node.tokens[cut:]
        node.values = node.values[num_blocks:]
        node.key = node.tokens[: self.block_size].tobytes()
        node.parent = head
        head.children[node.key] = node
        self._num_nodes += 1
        return head

    def truncate(self, node: RadixNode, num_blocks: int) -> list[tuple[RadixNode, list[int]]]:
        """Drop the last ``num_blocks`` blocks of ``node`` and every descendant of it.

        Returns the dropped values grouped by the node that held them (``node`` first,
        which stays in the tree while it has blocks left). Dropping all of its blocks
        removes the node.
        """
        if node is self.root or not 0 < num_blocks <= len(node.values):
            raise ValueError(f"cannot drop {num_blocks} blocks of a node of {len(node.values)}")
        if num_blocks == len(node.values):
            return self.remove(node)
        dropped: list[tuple[RadixNode, list[int]]] = []
        for child in list(node.children.values()):
            dropped += self.remove(child)
        keep = len(node.values) - num_blocks
        tail = node.values[keep:]
        node.values = node.values[:keep]
        node.tokens = node.tokens[: keep * self.block_size]
        self._num_blocks -= num_blocks
        return [(node, tail), *dropped]

    def remove(self, node: RadixNode) -> list[tuple[RadixNode, list[int]]]:
        """Remove ``node`` and its subtree; return their values grouped by node (preorder)."""
        if node is self.root:
            raise ValueError("cannot remove the root")
        parent = node.parent
        if parent is None or parent.children.get(node.key) is not node:
            raise ValueError("node is not in this tree")
        del parent.children[node.key]
        out = []
        stack = [node]
        while stack:
            n = stack.pop()
            out.append((n, n.values))
            stack.extend(n.children.values())
            n.parent = None
        self._num_nodes -= len(out)
        self._num_blocks -= sum(len(v) for _, v in out)
        return out

    def expire(self, now: float | None = None) -> list[tuple[RadixNode, list[int]]]:
        """Remove every node whose expiry time has passed, with its subtree."""
        if now is None:
            now = self._clock()
        dropped: list[tuple[RadixNode, list[int]]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                if child.expires_at is not None and child.expires_at <= now:
                    dropped += self.remove(child)
                else:
                    stack.append(child)
        return dropped

    # -- iteration ---------------------------------------------------------------------

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def leaves(self) -> Iterator[RadixNode]:
        """Nodes without children."""
        return (n for n in self.nodes() if not n.children)

    def path(self, node: RadixNode) -> list[RadixNode]:
        """Nodes from the root's child down to ``node``."""
        out = []
        while node is not self.root:
            out.append(node)
            assert node.parent is not None, "node is detached"
            node = node.parent
        return out[::-1]

    def tokens_of(self, node: RadixNode) -> array:
        """The full token prefix ending with ``node``."""
        out = array(TOKEN_TYPECODE)
        for n in self.path(node):
            out += n.tokens
        return out

    def __len__(self) -> int:
        return self._num_blocks
