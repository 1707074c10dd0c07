"""Tokenizing straight through a fast tokenizer's Rust backend (the ``tokenizers`` library).

HF's fast ``encode`` is a thin layer over the backend's ``encode_batch``, but the layer flips state on the
shared backend object around calls (truncation, padding, whether special tokens are parsed), which races
when several threads tokenize at once, and the full ``Encoding`` it builds (offsets and token strings)
takes Python's global lock to free: about 0.1 s for a 4 MB text, during which no other thread runs.
Here each use gets a private copy of the backend, set up once, and ``encode_batch_fast`` builds only ids.
"""

from __future__ import annotations

from typing import Any


def encodes_generically(hf: Any) -> bool:
    """Whether ``hf.encode`` is HF's generic fast path, so that the backend alone gives the same ids.

    A tokenizer class that overrides the encoding methods (Code Llama's fill-in-the-middle handling, for
    one) keeps going through HF.

    Args:
        hf: a HF tokenizer.

    Returns:
        True for a fast tokenizer whose class encodes exactly as ``PreTrainedTokenizerFast`` does.
    """
    if not getattr(hf, "is_fast", False):
        return False
    from transformers import PreTrainedTokenizerFast

    methods = [name for name in ("encode", "_encode_plus", "_batch_encode_plus") if hasattr(PreTrainedTokenizerFast, name)]
    return all(getattr(type(hf), name, None) is getattr(PreTrainedTokenizerFast, name) for name in methods)


def private_copy(backend: Any, split_special_tokens: bool) -> Any:
    """An independent copy of a Rust tokenizer, with no truncation or padding.

    Args:
        backend: the ``tokenizers.Tokenizer`` to copy.
        split_special_tokens: read special tokens' strings as plain text.

    Returns:
        The copy (a ``tokenizers.Tokenizer``), safe to call from several threads at once since nothing
        changes it after this.
    """
    from tokenizers import Tokenizer as RustTokenizer

    copy = RustTokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = split_special_tokens
    return copy


def encode_ids(backend: Any, text: str, add_special_tokens: bool) -> list[int]:
    """The ids of ``text``: the lock is released while the Rust code runs, and held only to build the list.

    Args:
        backend: a private ``tokenizers.Tokenizer`` (:func:`private_copy`).
        text: the text.
        add_special_tokens: let the backend's post-processor add BOS/EOS.

    Returns:
        The token ids, as ``encode_batch`` gives them.
    """
    return encode_ids_many(backend, [text], add_special_tokens)[0]


def encode_ids_many(backend: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """:func:`encode_ids` of several texts in one call (the backend encodes a batch in parallel)."""
    # ``encode_batch_fast`` (tokenizers 0.21+) skips the offsets, whose freeing dominates for long texts
    encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
    return [encoding.ids for encoding in encode(texts, add_special_tokens=add_special_tokens)]
