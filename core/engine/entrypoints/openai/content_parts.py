"""Refusing chat content parts the model cannot take (images, audio, files), naming what it accepts."""

from __future__ import annotations

from engine.entrypoints.openai.errors import OpenAIError, bad_request
from engine.entrypoints.openai.protocol import ChatMessage

#: the content part types the engine's models take: every architecture it runs reads text only
ACCEPTED_PART_TYPES = ("text",)
#: OpenAI's content part types (chat and responses APIs), in the words a refusal uses
PART_KINDS = {
    "text": "text",
    "image_url": "images",
    "input_image": "images",
    "input_audio": "audio",
    "audio_url": "audio",
    "video_url": "video",
    "file": "files",
    "input_file": "files",
}


def check_content_parts(messages: list[ChatMessage], accepted: tuple[str, ...] = ACCEPTED_PART_TYPES) -> None:
    """Refuse the first content part whose type the model does not accept.

    Args:
        messages: the request's conversation.
        accepted: the part types the model takes.

    Raises:
        OpenAIError: 400 on ``messages``, e.g. ``messages[0].content[1]: this model does not accept images
            (it accepts: text)``.
    """
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type not in accepted:
                raise _refusal(f"messages[{i}].content[{j}]", part.type, accepted)


def _refusal(where: str, part_type: str, accepted: tuple[str, ...]) -> OpenAIError:
    kind = PART_KINDS.get(part_type, f"{part_type!r} content parts")
    takes = ", ".join(PART_KINDS.get(t, t) for t in accepted)
    message = f"{where}: this model does not accept {kind} (it accepts: {takes})"
    return bad_request(message, param="messages", code="unsupported_content")


__all__ = ["ACCEPTED_PART_TYPES", "check_content_parts"]
