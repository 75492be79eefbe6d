"""A disk tier's store: one file per block id (``blk-<id>.kv``) under a directory the user
gives, so the tier never holds more files than its capacity in blocks.

Writes leave the step path: a write copies the block to host memory and queues it for a
writer thread; a full queue refuses the block (the books drop it instead of demoting it),
so a step never waits on the disk. A block queued but not yet written is read from the
queue. Each file is written under a temporary name and renamed, so a crash leaves either the
old file or the new one whole.

Each file carries the hash of the token path it caches (a chain: a block's hash covers its
parent's hash and its own tokens) and a digest of everything in it. A read checks both: a
torn, truncated or altered file, or one that caches another path, is a miss, never wrong
tokens. At start the store reads the headers it finds and rebuilds the paths (a file whose
parent is missing is dropped); files of another model, dtype or block layout are removed,
and the log says why. A lock file keeps a second pool out of the directory."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import queue
import struct
import threading
from array import array
from collections.abc import Sequence
from pathlib import Path

import torch

from ..blocks.layout import AGGREGATED, KVLayout
from ..errors import ConfigError
from .radix import TOKEN_TYPECODE
from .stores import BlockStore

log = logging.getLogger(__name__)

MAGIC = b"MMSKV001"
HEADER = struct.Struct("<8s16s16s16sQ")  # magic, path hash, parent hash, digest, data bytes
ROOT = bytes(16)  # the parent hash of a first block
# Bytes of blocks waiting for the writer at most (more are dropped, never waited on): one long
# prompt's KV of a 70B model (12k tokens at 320 KiB), which one prefill may push down at once
QUEUE_BYTES = 4 << 30
MANIFEST = "manifest.json"
LOCK = "lock"
FORMAT = 1


def queue_blocks_for(block_bytes: int) -> int:
    """The write queue's length in blocks of ``block_bytes``: :data:`QUEUE_BYTES` of them."""
    return max(1, QUEUE_BYTES // block_bytes)


def path_hashes(path: array, block_size: int) -> list[bytes]:
    """The hash of each block along a token path: a block's covers its parent's and its tokens."""
    out, h = [], ROOT
    for i in range(0, len(path) - len(path) % block_size, block_size):
        h = hashlib.blake2b(h + path[i : i + block_size].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


def _digest(head: bytes, tokens: bytes, data: bytes) -> bytes:
    h = hashlib.blake2b(head, digest_size=16)
    h.update(tokens)
    h.update(data)
    return h.digest()


def _blob(path_hash: bytes, parent: bytes, tokens: bytes, data: torch.Tensor) -> bytes:
    """A block file: header (with the digest of all of it), tokens, data."""
    body = data.contiguous().view(torch.uint8).numpy().tobytes()
    head = HEADER.pack(MAGIC, path_hash, parent, bytes(16), len(body))
    digest = _digest(head, tokens, body)
    return HEADER.pack(MAGIC, path_hash, parent, digest, len(body)) + tokens + body


class DiskStore(BlockStore):
    """``num_blocks`` block files under ``directory`` for KV of ``layout`` / ``dtype`` from
    ``model``; a writer thread drains a queue of at most ``queue_blocks`` blocks (default:
    :data:`QUEUE_BYTES` of them)."""

    def __init__(
        self,
        directory: Path,
        num_blocks: int,
        layout: KVLayout,
        dtype: torch.dtype,
        model: str,
        queue_blocks: int | None = None,
    ) -> None:
        if layout.kind != AGGREGATED:
            raise ConfigError("the disk tier stores aggregated blocks (one file per block)")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.num_blocks = num_blocks
        self.block_size = layout.block_size
        self.shape = layout.pool_shape(1)[1:]
        self.dtype = dtype
        self.data_bytes = layout.block_bytes(dtype.itemsize)
        self.tok_bytes = self.block_size * array(TOKEN_TYPECODE).itemsize
        self._lock_fd = _lock(self.directory)
        self.counters = dict.fromkeys(
            "written_blocks write_refused write_failed read_blocks corrupt_blocks".split(), 0
        )
        self._meta = {
            "format": FORMAT,
            "model": model,
            "layout": repr(layout),
            "dtype": str(dtype),
            "token_bytes": self.tok_bytes,
        }
        try:
            self._restored = self._open()
        except BaseException:
            os.close(self._lock_fd)  # the directory is free again
            raise
        self._queue: queue.Queue = queue.Queue()
        if queue_blocks is None:
            queue_blocks = queue_blocks_for(self.data_bytes)
        self._room = queue_blocks  # queue slots neither filled nor reserved
        self._reserved = 0
        # id -> (write seq, path hash, parent hash, tokens, data): queued, not yet on disk
        self._pending: dict[int, tuple] = {}
        self._seq = 0
        self._mutex = threading.Lock()
        self._staged: dict[int, torch.Tensor] = {}  # blocks checked by readable, for read
        self._writer = threading.Thread(target=self._drain, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # -- the books' hooks -----------------------------------------------------------------

    def intake(self, n: int) -> int:
        """Reserve room in the write queue for up to ``n`` blocks; return how many it has."""
        with self._mutex:
            got = min(n, self._room)
            self._room -= got
            self._reserved += got
        self.counters["write_refused"] += n - got
        return got

    def readable(self, ids: list[int], path: array) -> int:
        """How many leading blocks of ``ids`` (the last blocks of ``path``) read back intact
        and cache that path; those are staged for ``read``."""
        hashes = path_hashes(path, self.block_size)[-len(ids) :]
        good = 0
        for b, h in zip(ids, hashes, strict=True):
            data = self._load(b, h)
            if data is None:
                self.counters["corrupt_blocks"] += 1
                break
            self._staged[b] = data
            good += 1
        return good

    # -- BlockStore -----------------------------------------------------------------------

    def read(self, ids: Sequence[int]) -> torch.Tensor:
        out = torch.empty((len(ids), *self.shape), dtype=self.dtype)
        for i, b in enumerate(ids):
            data = self._staged.pop(b, None)
            if data is None:
                raise ValueError(f"disk block {b} was read before it was checked")
            out[i].copy_(data)
        self.counters["read_blocks"] += len(ids)
        return out

    def write(self, ids: Sequence[int], data: torch.Tensor, path: array) -> None:
        """Queue the blocks (a copy in host memory and their path's hashes); the writer thread
        builds and writes the files."""
        bs, n = self.block_size, len(ids)
        hashes = path_hashes(path, bs)
        first = len(hashes) - n
        raw = data.detach().to("cpu", copy=True)
        with self._mutex:
            self._reserved -= n
            for i, b in enumerate(ids):
                at = first + i
                parent = hashes[at - 1] if at else ROOT
                toks = path[at * bs : (at + 1) * bs].tobytes()
                self._seq += 1
                self._pending[b] = (self._seq, hashes[at], parent, toks, raw[i])
                self._queue.put_nowait((b, self._seq))

    def restored(self) -> list[tuple[array, list[int]]]:
        out, self._restored = self._restored, []
        return out

    def stats(self) -> dict[str, int]:
        return dict(self.counters) | {"queued_blocks": self._queue.qsize()}

    def done(self) -> None:
        self._staged.clear()

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes, stop the writer, release the directory."""
        if self._lock_fd is None:
            return
        self._queue.put(None)
        self._writer.join()
        os.close(self._lock_fd)
        self._lock_fd = None

    # -- files ----------------------------------------------------------------------------

    def _file(self, b: int) -> Path:
        return self.directory / f"blk-{b:08d}.kv"

    def _drain(self) -> None:
        """The writer thread: write each queued block unless a newer write of it follows."""
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                b, seq = item
                with self._mutex:
                    entry = self._pending.get(b)
                if entry is not None and entry[0] == seq:
                    self._write_file(b, _blob(*entry[1:]))
                with self._mutex:
                    if self._pending.get(b, (0,))[0] == seq:
                        del self._pending[b]
                    self._room += 1
            finally:
                self._queue.task_done()

    def _write_file(self, b: int, blob: bytes) -> None:
        tmp = self.directory / f"tmp-{b:08d}.kv"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._file(b))
            self.counters["written_blocks"] += 1
        except OSError as e:  # the block reads back as a miss
            log.warning("disk tier %s: writing block %d failed: %s", self.directory, b, e)
            self.counters["write_failed"] += 1

    def _load(self, b: int, expect: bytes) -> torch.Tensor | None:
        """Block ``b`` if it is whole, unaltered and caches the path hashed ``expect``."""
        with self._mutex:
            entry = self._pending.get(b)
        if entry is not None:  # still queued: in memory, unaltered
            return entry[4] if entry[1] == expect else None
        end = HEADER.size + self.tok_bytes
        blob = bytearray(end + self.data_bytes + 1)  # one byte more: a longer file is wrong too
        try:
            with open(self._file(b), "rb", buffering=0) as f:
                size = f.readinto(blob)
        except OSError:
            return None
        if size != end + self.data_bytes or not self._intact(memoryview(blob)[:size], expect):
            return None
        flat = torch.frombuffer(blob, dtype=torch.uint8, count=self.data_bytes, offset=end)
        return flat.view(self.dtype).view(self.shape)

    def _intact(self, blob: memoryview, expect: bytes) -> bool:
        """Whether a block file's header, digest and path hash (``expect``) hold."""
        end = HEADER.size + self.tok_bytes
        magic, path_h, parent, digest, size = HEADER.unpack_from(blob)
        if magic != MAGIC or size != self.data_bytes or path_h != expect:
            return False
        head = HEADER.pack(magic, path_h, parent, bytes(16), size)
        return _digest(head, blob[HEADER.size : end], blob[end:]) == digest

    def _open(self) -> list[tuple[array, list[int]]]:
        """Check the directory's manifest against this store; rebuild the cached paths from
        the block files' headers (the blocks themselves are checked when read)."""
        manifest = self.directory / MANIFEST
        for tmp in self.directory.glob("tmp-*.kv"):
            tmp.unlink()
        files = sorted(self.directory.glob("blk-*.kv"))
        try:
            found = json.loads(manifest.read_text())
        except (OSError, ValueError):
            found = None
        if found != self._meta:
            if files:
                why = "no manifest" if found is None else _differs(found, self._meta)
                log.warning(
                    "disk tier %s: starting empty, %d block files removed (%s)",
                    self.directory,
                    len(files),
                    why,
                )
            for f in files:
                f.unlink()
            manifest.write_text(json.dumps(self._meta, indent=1))
            return []
        return self._rebuild(files)

    def _headers(self, files: list[Path]) -> dict[bytes, tuple[bytes, int, bytes]]:
        """Each block file's ``path hash -> (parent hash, id, tokens)``; files out of range,
        unreadable or caching a path another file caches are removed."""
        entries: dict[bytes, tuple[bytes, int, bytes]] = {}
        end = HEADER.size + self.tok_bytes
        for f in files:
            b = int(f.stem[4:]) if f.stem[4:].isdigit() else self.num_blocks
            try:
                with open(f, "rb") as fh:
                    head = fh.read(end)
            except OSError:
                head = b""
            _, h, parent, _, _ = HEADER.unpack_from(head) if len(head) == end else (0,) * 5
            if b >= self.num_blocks or head[:8] != MAGIC or h in entries:
                f.unlink()
                continue
            entries[h] = (parent, b, head[HEADER.size :])
        return entries

    def _rebuild(self, files: list[Path]) -> list[tuple[array, list[int]]]:
        """The paths the block files cache, each as (tokens, block ids), leaves only."""
        entries = self._headers(files)
        paths: dict[bytes, tuple[array, list[int]] | None] = {ROOT: (array(TOKEN_TYPECODE), [])}

        def resolve(h: bytes) -> tuple[array, list[int]] | None:
            chain = []
            while h not in paths:
                if h not in entries:
                    break
                chain.append(h)
                h = entries[h][0]
            base = paths.get(h)
            for c in reversed(chain):
                parent, b, toks = entries[c]
                if base is not None:
                    base = (base[0] + array(TOKEN_TYPECODE, toks), base[1] + [b])
                paths[c] = base
            return base

        parents = {p for p, _, _ in entries.values()}
        out = []
        for h, (_, b, _) in entries.items():
            got = resolve(h)
            if got is None:  # its parent is gone: it can never be matched
                self._file(b).unlink()
            elif h not in parents:
                out.append(got)
        return out


def _lock(directory: Path) -> int:
    """Hold ``directory``'s lock file for the life of the store, or refuse, naming it."""
    path = directory / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ConfigError(
            f"disk tier directory {directory} is in use by another instance "
            f"(pid {holder}, lock file {path}); give each instance its own disk_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _differs(found: dict, want: dict) -> str:
    keys = [k for k in want if found.get(k) != want[k]]
    return "; ".join(f"{k}: was {found.get(k)!r}, now {want[k]!r}" for k in keys)
