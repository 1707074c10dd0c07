"""Which data-parallel replica takes a request: the one likely to hold the longest part of its prompt in
its prefix cache, otherwise the least loaded one.

The router cannot see the replicas' caches (they live in other processes); it remembers which prompt
blocks it sent where, keyed like the prefix cache keys its blocks (a chained hash of each full block of
tokens and the request's cache salt), and forgets the oldest once a replica has been sent more distinct
blocks than its KV pool holds (those are the ones its cache has most likely evicted).
"""

from __future__ import annotations

import array
from collections import OrderedDict

from engine.prefix_hash import ROOT_HASH, block_content, content_hash, encode_extra_key

#: a replica whose cache holds part of the prompt still loses the request when it has this many more
#: requests in flight than the least loaded replica (a hot prefix must not pile every request on one)
DEFAULT_MAX_IMBALANCE = 8


def prompt_block_keys(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """The chained keys of the prompt's full blocks (a partial last block is never shared)."""
    extra = encode_extra_key(cache_salt)
    keys: list[bytes] = []
    parent = ROOT_HASH
    for index in range(len(token_ids) // block_size):
        packed = array.array("q", token_ids[index * block_size : (index + 1) * block_size]).tobytes()
        parent = content_hash(block_content(parent, index, packed, extra))
        keys.append(parent)
    return keys


class PrefixAwareRouter:
    """Routes requests over ``len(capacities)`` replicas and counts each one's requests in flight.

    Args:
        capacities: each replica's KV pool size in blocks (how many block keys it is remembered for).
        block_size: the tokens per KV block of the replicas.
        max_imbalance: see :data:`DEFAULT_MAX_IMBALANCE`.
    """

    def __init__(self, capacities: list[int], block_size: int, max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> None:
        if not capacities:
            raise ValueError("a router needs at least one replica")
        self.capacities = [max(1, c) for c in capacities]
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        #: requests in flight per replica
        self.load = [0] * len(capacities)
        self._sent: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in capacities]
        self._next_tie = 0

    @property
    def num_replicas(self) -> int:
        return len(self.capacities)

    def cached_blocks(self, replica: int, keys: list[bytes]) -> int:
        """How many of the leading ``keys`` were sent to ``replica`` and not forgotten since."""
        sent = self._sent[replica]
        count = 0
        for key in keys:
            if key not in sent:
                break
            count += 1
        return count

    def choose(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """The replica for a prompt; it is counted as one more request in flight there.

        Returns:
            The replica's index.
        """
        keys = prompt_block_keys(token_ids, self.block_size, cache_salt)
        least = min(self.load)
        hits = [self.cached_blocks(r, keys) for r in range(self.num_replicas)]
        best = max(hits)
        candidates = [
            r for r in range(self.num_replicas)
            if best > 0 and hits[r] == best and self.load[r] <= least + self.max_imbalance
        ]  # fmt: skip
        if not candidates:
            candidates = [r for r in range(self.num_replicas) if self.load[r] == least]
        # among equals, the next one in turn, so that an idle group fills evenly
        replica = min(candidates, key=lambda r: (self.load[r], (r - self._next_tie) % self.num_replicas))
        self._next_tie = (replica + 1) % self.num_replicas
        self._remember(replica, keys)
        self.load[replica] += 1
        return replica

    def finished(self, replica: int) -> None:
        """A request routed to ``replica`` finished or was aborted."""
        self.load[replica] = max(0, self.load[replica] - 1)

    def _remember(self, replica: int, keys: list[bytes]) -> None:
        sent = self._sent[replica]
        for key in keys:
            sent[key] = None
            sent.move_to_end(key)
        while len(sent) > self.capacities[replica]:
            sent.popitem(last=False)
