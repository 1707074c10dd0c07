"""Suffix decoding: proposals read from depth-limited suffix tries with counts, one per running sequence
(over its prompt and its output so far) and one shared by all (over the outputs of recently finished
sequences). Strong where outputs repeat themselves, their prompts or earlier outputs (agent loops, edits,
templated answers); the global trie lets a request that was seen before be proposed from its start."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass


class _Node:
    """A trie node: how often its path occurred, and its continuations."""

    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


@dataclass(frozen=True, slots=True)
class Proposal:
    """Proposed tokens and their expected accepted length (the sum of the running products of their
    estimated probabilities)."""

    tokens: list[int]
    score: float


class SuffixTrie:
    """Every substring of at most ``max_depth`` tokens of what it holds, as a path from the root; each node
    counts the occurrences of its path.

    It follows one token stream online (:meth:`extend`, a running sequence's trie) and can hold whole
    sequences besides (:meth:`insert` / :meth:`remove`, the global trie).

    Args:
        max_depth: the longest substring kept; it bounds the match plus the proposal.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        #: the nodes of the stream's suffixes that end at its last token, shortest first (index i: depth i + 1)
        self.active: list[_Node] = []
        #: tokens of the stream fed so far
        self.num_tokens = 0

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the followed stream; O(``max_depth``) per token."""
        self.active = self._add(tokens, self.active)
        self.num_tokens += len(tokens)

    def insert(self, tokens: Iterable[int]) -> None:
        """Add a whole sequence, apart from the followed stream."""
        self._add(tokens, [])

    def remove(self, tokens: Iterable[int]) -> None:
        """Take back a sequence that :meth:`insert` added: its paths' counts go down by what it added, and
        nodes left at zero are removed.

        Raises:
            KeyError: ``tokens`` was not inserted.
        """
        root, keep = self.root, self.max_depth - 1
        active: list[_Node] = []
        for token in tokens:
            deeper = []
            for node in [root, *active[:keep]]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    # its subtree's counts all come from this sequence's later positions, which the walk
                    # still reaches through the detached node
                    del node.children[token]
                deeper.append(child)
            active = deeper

    def find(self, path: list[int]) -> _Node | None:
        """The node of ``path`` (None: it never occurred)."""
        node = self.root
        for token in path:
            found = node.children.get(token)
            if found is None:
                return None
            node = found
        return node

    def _add(self, tokens: Iterable[int], active: list[_Node]) -> list[_Node]:
        root, keep = self.root, self.max_depth - 1
        for token in tokens:
            deeper = []
            # the nodes at max_depth have no room below them
            for node in [root, *active[:keep]]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                deeper.append(child)
            active = deeper
        return active


class SuffixCache:
    """The global trie: the outputs of the latest ``capacity`` finished sequences, the oldest evicted first.

    Args:
        max_depth: the trie's depth.
        capacity: how many sequences it holds.
    """

    def __init__(self, max_depth: int, capacity: int) -> None:
        self.trie = SuffixTrie(max_depth)
        self.capacity = capacity
        self._held: deque[list[int]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        """Forget every held sequence."""
        self.trie = SuffixTrie(self.trie.max_depth)
        self._held.clear()

    def add(self, tokens: list[int]) -> None:
        """Hold a finished sequence's output (a copy), evicting the oldest when full."""
        if not tokens or self.capacity <= 0:
            return
        if len(self._held) >= self.capacity:
            self.trie.remove(self._held.popleft())
        held = list(tokens)
        self.trie.insert(held)
        self._held.append(held)


def propose_suffix(
    local: SuffixTrie,
    cache: SuffixTrie | None,
    tail: list[int],
    k: int,
    max_spec_factor: float,
    min_token_prob: float,
) -> list[int]:
    """Up to ``k`` tokens for a sequence whose stream ``local`` follows: from the local and the global
    trie, the proposal with the higher expected accepted length (local on ties).

    Args:
        local: the sequence's own trie, fed up to its last token.
        cache: the global trie (None: off).
        tail: the sequence's last ``max_depth - 1`` tokens (or all of them, when fewer).
        k: the most tokens to propose.
        max_spec_factor: a match of n tokens proposes at most ``floor(max_spec_factor * n)``.
        min_token_prob: the walk stops before a token whose estimated probability is lower.

    Returns:
        The proposed tokens (empty: nothing matched well enough).
    """
    active = local.active
    best = _propose(lambda n: active[n - 1], min(len(active), len(tail)), local.max_depth, k, max_spec_factor, min_token_prob)
    if cache is not None and cache.root.children:
        other = _propose(lambda n: cache.find(tail[-n:]), len(tail), cache.max_depth, k, max_spec_factor, min_token_prob)
        if other.score > best.score:
            best = other
    return best.tokens


def _propose(
    node_of: Callable[[int], _Node | None],
    longest: int,
    max_depth: int,
    k: int,
    factor: float,
    min_prob: float,
) -> Proposal:
    """Match the longest suffix (of at most ``longest`` tokens) that has a continuation, shortened where the
    trie's depth would cut the walk short, then walk down to the likeliest child while it is likely enough."""
    matched = _longest_continued(node_of, min(longest, max_depth - 1))
    length = _match_length(matched, k, factor, max_depth)
    if length == 0:
        return Proposal([], 0.0)
    node = node_of(length)
    assert node is not None
    limit = _limit(length, k, factor, max_depth)
    tokens: list[int] = []
    score, running = 0.0, 1.0
    while len(tokens) < limit and node.children:
        total, best_token, best = 0, -1, None
        for token, child in node.children.items():
            total += child.count
            if best is None or child.count > best.count:
                best_token, best = token, child
        assert best is not None
        prob = best.count / total
        if prob < min_prob:
            break
        running *= prob
        score += running
        tokens.append(best_token)
        node = best
    return Proposal(tokens, score)


def _longest_continued(node_of: Callable[[int], _Node | None], longest: int) -> int:
    """The longest n <= ``longest`` whose suffix node has children (0: none).

    Binary search: a suffix followed by a token somewhere has every shorter suffix followed by it there.
    """
    low, high = 0, longest
    while low < high:
        mid = (low + high + 1) // 2
        node = node_of(mid)
        if node is not None and node.children:
            low = mid
        else:
            high = mid - 1
    return low


def _limit(length: int, k: int, factor: float, max_depth: int) -> int:
    # the small epsilon keeps floor(0.3 * 10) at 3 despite binary floating point
    return max(0, min(k, int(factor * length + 1e-9), max_depth - length))


def _match_length(matched: int, k: int, factor: float, max_depth: int) -> int:
    """The match length (at most ``matched``) that allows the longest walk, the longer on ties: a long match
    leaves the depth-limited trie little room below it."""
    best, best_limit = 0, 0
    for length in range(matched, 0, -1):
        limit = _limit(length, k, factor, max_depth)
        if limit > best_limit:
            best, best_limit = length, limit
        if max_depth - length >= min(k, int(factor * length + 1e-9)):
            break  # the depth no longer binds: shorter matches only allow shorter walks
    return best
