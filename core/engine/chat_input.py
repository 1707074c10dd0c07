"""A conversation to prompt token ids, where the text of a message never becomes a special token.

The chat template renders a conversation to one string, and tokenizing that string with special tokens
recognised would also turn a ``<|im_end|>`` typed inside a message into the real end-of-turn token: a
user could close their own turn and open a system one. Here only the template's own text may hold
special tokens; every message's text is read as plain text.

How: the template is rendered a second time with each message's text replaced by a unique placeholder,
which splits the rendering into the template's pieces. When tokenizing the real rendering the usual way
gives exactly the special tokens the template's pieces hold, those ids are returned as they are (so a
conversation without special-token text is tokenized exactly as before). Otherwise the pieces are
tokenized with special tokens recognised and each message's text as plain text, and spliced.

Every chat-shaped input (OpenAI chat, and the Anthropic and Responses APIs) goes through
:func:`encode_conversation`.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.chat_tools import check_no_special_text, prepare_chat
from engine.errors import InvalidRequestError
from engine.input_processor import check_prompt_chars
from engine.loader.tokenizer import Tokenizer

#: how a template may have changed a message's text on the way in: kept, or trimmed (``| trim``)
_TEXT_VARIANTS = (lambda s: s, str.strip, str.lstrip, str.rstrip)


def encode_conversation(
    tokenizer: Tokenizer,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    allow_special_tokens: bool = False,
    max_model_len: int | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Render ``messages`` with the model's chat template and tokenize the result.

    Args:
        tokenizer: the model's tokenizer (it holds the chat template).
        messages: ``{"role", "content"}`` dicts (content: a string or a list of text parts).
        add_generation_prompt: end with the header that starts the assistant's turn.
        allow_special_tokens: read special-token strings in messages as special tokens (for trusted
            callers only: any message can then end its turn and start another).
        max_model_len: refuse, before tokenizing it, a rendering whose characters alone cannot fit in a
            context of this many tokens (``check_prompt_chars``); None: no bound.
        tools: OpenAI function tools, rendered by the template or in the Hermes format
            (:func:`engine.chat_tools.prepare_chat`, which also handles messages with tool calls).
        template_kwargs: extra template variables (``{"enable_thinking": False}``).

    Returns:
        The prompt's token ids (no BOS added beyond what the template writes).

    Raises:
        ValueError: the template refused the conversation, or a message is malformed.
        InvalidRequestError: the rendering cannot fit ``max_model_len`` (``context_length_exceeded``), or a
            message holds special-token text that this template does not keep apart from its own
            markers (it rewrites message text in a way this module does not follow), or tools, call
            arguments or template variables hold special-token text; or a reserved template variable.
        engine.loader.errors.ModelLoadError: the model has no chat template.
    """
    prepared = prepare_chat(tokenizer, messages, tools, template_kwargs)
    if not allow_special_tokens:
        check_no_special_text(tokenizer, prepared)
    normalized = prepared.messages
    render = functools.partial(
        tokenizer.apply_chat_template, tools=prepared.tools, template_kwargs=prepared.template_kwargs
    )
    rendered = render(normalized, add_generation_prompt=add_generation_prompt)
    if max_model_len is not None:
        check_prompt_chars(len(rendered), max_model_len, tokenizer.max_token_chars, "messages")
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    special = tokenizer.special_token_ids
    if allow_special_tokens or not special:
        return ids
    texts = [message["content"] for message in normalized]
    pieces = _template_pieces(render, normalized, add_generation_prompt)
    if pieces is None:
        # The template does not place each message's text once, in order: it cannot be split apart.
        if not any(_holds_special_text(tokenizer, text) for text in texts):
            return ids
        raise _inseparable()
    template_specials = [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False) if t in special]
    if [t for t in ids if t in special] == template_specials:
        return ids  # every special token in the prompt is the template's own
    placed = _placed_texts(rendered, pieces, [text for text in texts if text])
    if placed is None:
        raise _inseparable()
    out: list[int] = []
    for piece, text in zip(pieces, [*placed, ""]):
        out += tokenizer.encode(piece, add_special_tokens=False)
        if text:
            out += tokenizer.encode_plain(text)
    return out


def _template_pieces(
    render: Callable[..., str], normalized: list[dict[str, Any]], add_generation_prompt: bool
) -> list[str] | None:
    """The template's own text around the messages' texts (one more piece than non-empty messages).

    Empty texts stay empty, so that a template testing ``if message.content`` takes the same branch.

    Returns:
        The pieces, or None when some placeholder is not in the rendering exactly once, in order.
    """
    nonce = secrets.token_hex(8)
    marks: list[str] = []
    skeleton_messages = []
    for index, message in enumerate(normalized):
        if message["content"]:
            # private-use characters around a random nonce: no real text or template holds this
            marks.append(f"\ue000{nonce}.{index}\ue001")
            skeleton_messages.append({**message, "content": marks[-1]})
        else:
            skeleton_messages.append(message)
    skeleton = render(skeleton_messages, add_generation_prompt=add_generation_prompt)
    pieces: list[str] = []
    start = 0
    for mark in marks:
        at = skeleton.find(mark, start)
        if at < 0 or skeleton.count(mark) != 1:
            return None
        pieces.append(skeleton[start:at])
        start = at + len(mark)
    pieces.append(skeleton[start:])
    return pieces


def _placed_texts(rendered: str, pieces: list[str], texts: list[str]) -> list[str] | None:
    """Each message's text as it stands in ``rendered`` between the template's ``pieces``.

    A template may trim a message's text; each text is matched as it is or trimmed, and the whole
    rendering must be rebuilt exactly from the pieces and the texts.

    Returns:
        The texts, or None when the rendering is not the pieces with these texts in between.
    """
    if len(pieces) != len(texts) + 1 or not rendered.startswith(pieces[0]):
        return None
    at = len(pieces[0])
    placed: list[str] = []
    for text, after in zip(texts, pieces[1:]):
        for variant in _TEXT_VARIANTS:
            candidate = variant(text)
            if rendered.startswith(candidate, at) and rendered.startswith(after, at + len(candidate)):
                placed.append(candidate)
                at += len(candidate) + len(after)
                break
        else:
            return None
    return placed if at == len(rendered) else None


def _holds_special_text(tokenizer: Tokenizer, text: str) -> bool:
    return any(t in tokenizer.special_token_ids for t in tokenizer.encode(text, add_special_tokens=False))


def _inseparable() -> InvalidRequestError:
    return InvalidRequestError(
        "a message holds special-token text (such as an end-of-turn marker), and this model's chat template "
        "rewrites message text in a way that keeps it from being read as plain text; remove it, or start a "
        "trusted server with --allow-special-tokens-in-messages",
        param="messages",
    )
