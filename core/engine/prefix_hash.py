"""The prefix cache's block keys: a chained SHA-256 over a block's parent, index, tokens and extra key."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

#: the parent hash of a sequence's first block
ROOT_HASH = bytes(32)


def encode_extra_key(extra_key: object) -> bytes:
    """A deterministic, unambiguous byte form of a block's extra key (empty for None).

    Args:
        extra_key: None, a str, bytes, an int, or a tuple of these (nested tuples allowed).

    Raises:
        TypeError: for any other type (its hash would not be stable across processes).
    """
    return b"" if extra_key is None else _encode_key_part(extra_key)


def _encode_key_part(part: object) -> bytes:
    # A type tag and a length before each value, so that no two different keys give the same bytes.
    if part is None:
        return b"n"
    if isinstance(part, tuple):
        return b"t" + len(part).to_bytes(8, "little") + b"".join(_encode_key_part(p) for p in part)
    if isinstance(part, str):
        tag, data = b"s", part.encode("utf-8")
    elif isinstance(part, bytes):
        tag, data = b"b", part
    elif isinstance(part, int) and not isinstance(part, bool):
        tag, data = b"i", str(part).encode("ascii")
    else:
        raise TypeError(f"a prefix-cache extra key must be str, bytes, int, None or a tuple of them, got {type(part).__name__}")
    return tag + len(data).to_bytes(8, "little") + data


def block_content(parent_hash: bytes, index: int, packed_tokens: bytes, extra_key_bytes: bytes) -> bytes:
    """What a full block is hashed from and checked against: parent hash, position, token ids, extra key.

    The block's index in its sequence is implied by the chain; it is spelled out so that the content
    check alone keeps a block from being reused at another position, whatever the hash does. The
    parent hash, the index and the packed tokens have fixed sizes, so the concatenation is unambiguous.
    """
    return parent_hash + index.to_bytes(8, "little") + packed_tokens + extra_key_bytes


def content_hash(content: bytes) -> bytes:
    """The prefix-cache key of a block's content (SHA-256)."""
    return hashlib.sha256(content).digest()


@dataclass(slots=True)
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and how many were found."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
