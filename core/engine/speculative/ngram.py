"""The n-gram proposer (prompt lookup): copy what followed the latest earlier occurrence of the last n
tokens. Cheap and strong on copy-heavy outputs (edits, rewrites, code, quoting the prompt)."""

from __future__ import annotations


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` proposed tokens for a sequence ``tokens`` (prompt then output).

    Args:
        tokens: the sequence so far.
        k: most tokens to propose.
        min_n: the shortest suffix matched.
        max_n: the longest suffix matched (tried first).

    Returns:
        The tokens after the latest earlier occurrence of the longest matching suffix (empty: no match).
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # the latest occurrence that ends before the suffix itself
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
                break
    return []
