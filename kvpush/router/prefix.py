"""Prefix awareness: which decode probably holds a prompt's prefix.

Two sources, both pure and on the router's event loop only:

- **Session affinity** (:func:`session_key`, :func:`rendezvous_order`): a
  conversation names itself, by a header (default ``x-session-id``) or the
  OpenAI ``user`` field, and is mapped to decodes by rendezvous (highest
  random weight) hashing over the topology's decode engine ids. The order
  depends only on the key and the engine ids, so every router replica sends
  a session to the same decode without sharing anything, and losing one
  decode moves only that decode's sessions.
- **The prefix index** (:class:`PrefixIndex`): the chained hashes of the
  full prompt blocks (:func:`block_hashes`) the router has sent to each
  decode. It answers how many leading blocks of a new prompt a decode was
  sent before (:meth:`PrefixIndex.num_held_blocks`), which is what the skip
  decision needs. Its memory is bounded by ``max_entries`` (decode, block)
  pairs, least recently used evicted first: about 100 bytes each, so the
  default 65536 entries (8M tokens of prompt at 128-token blocks) are about
  7 MB.

The index learns from two sources: the prompts the router sent each decode
(:meth:`PrefixIndex.record` when a request was served), and, where a decode
publishes them, vLLM's KV cache events (``kv_events.py``): the blocks it
cached, whoever sent their prompt (another router replica, its own output),
and the blocks it evicted (:meth:`PrefixIndex.remove`). Without events the
index cannot see evictions (it says held, decode recomputes: correct, just
slower) nor blocks a decode got through another router replica (it says not
held: the prefill leg runs needlessly); docs/architecture.md, "Prefix
awareness".
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SESSION_KEY_MAX_CHARS = 256
_ROOT = b"kvpush-prefix-v1"


def block_hashes(
    tokens: Sequence[int], block_size: int, parent_hash: int | None = None
) -> tuple[int, ...]:
    """One chained hash per *full* block of ``tokens`` (a partial last block
    has none, as in vLLM's prefix cache): block *i*'s hash covers every token
    up to the end of block *i*. ``parent_hash``: the hash of the block before
    ``tokens[0]`` (None: they start the prompt)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, not {block_size}")
    out: list[int] = []
    parent = _ROOT if parent_hash is None else parent_hash.to_bytes(8, "little")
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        digest = hashlib.blake2b(parent, digest_size=8)
        digest.update(array("q", block).tobytes())
        parent = digest.digest()
        out.append(int.from_bytes(parent, "little"))
    return tuple(out)


class PrefixIndex:
    """The prompt blocks sent to each decode, bounded and least recently used.

    ``max_entries`` bounds the number of (decode engine id, block hash)
    pairs; recording past it evicts the least recently recorded or matched.
    """

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, not {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, int], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, engine_id: str, hashes: Iterable[int]) -> None:
        """``engine_id`` now holds these blocks (it was sent the prompt)."""
        for h in hashes:
            key = (engine_id, h)
            self._entries[key] = None
            self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def num_held_blocks(self, engine_id: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` ``engine_id`` holds (marks
        them recently used)."""
        num = 0
        for h in hashes:
            key = (engine_id, h)
            if key not in self._entries:
                break
            self._entries.move_to_end(key)
            num += 1
        return num

    def remove(self, engine_id: str, hashes: Iterable[int]) -> None:
        """``engine_id`` no longer holds these blocks (it evicted them)."""
        for h in hashes:
            self._entries.pop((engine_id, h), None)

    def forget(self, engine_id: str) -> None:
        """``engine_id`` holds nothing any more (it restarted or went down)."""
        for key in [k for k in self._entries if k[0] == engine_id]:
            del self._entries[key]


def session_key(
    headers: Mapping[str, str], body: Mapping[str, Any], header_name: str
) -> str | None:
    """The conversation a request belongs to: ``header_name``'s value, else
    the OpenAI ``user`` field; None when neither is a non-empty string (or
    one is longer than :data:`SESSION_KEY_MAX_CHARS`)."""
    for value in (headers.get(header_name), body.get("user")):
        if isinstance(value, str) and 0 < len(value) <= SESSION_KEY_MAX_CHARS:
            return value
    return None


def rendezvous_order(key: str, engine_ids: Iterable[str]) -> list[str]:
    """``engine_ids`` from the most to the least preferred for ``key``
    (highest random weight hashing: stable across processes and replicas)."""

    def weight(engine_id: str) -> bytes:
        data = f"{key}\x00{engine_id}".encode()
        return hashlib.blake2b(data, digest_size=8).digest()

    return sorted(engine_ids, key=weight, reverse=True)
