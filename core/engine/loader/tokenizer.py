"""The tokenizer: a thin wrapper over a HF tokenizer, loaded from a HF folder or a GGUF file."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from engine.loader.errors import ModelLoadError
from engine.loader.hf_folder import GENERATION_CONFIG_FILE, read_json
from engine.loader.paths import is_gguf_file
from engine.loader.rust_backend import encode_ids, encode_ids_many, encodes_generically, private_copy

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHAT_ROLES = ("system", "user", "assistant", "tool")
#: where transformers (4.43 and later) saves a tokenizer's chat template, beside tokenizer_config.json
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class Tokenizer:
    """Text <-> token ids and chat formatting for one model.

    Attributes:
        hf: the underlying HF tokenizer.
        eos_token_ids: ids that end generation (the tokenizer's EOS plus any extra stop ids).
        bos_token_id: beginning-of-sequence id, or None.
        vocab_size: number of token ids the tokenizer knows, added tokens included.
        files_dir: a folder holding these tokenizer files in Hugging Face's layout (the model folder, or
            the cached conversion of a GGUF file's tokenizer), for tools that load a tokenizer by path;
            None when there is none.
    """

    def __init__(
        self, hf: PreTrainedTokenizerBase, extra_eos_token_ids: list[int] | None = None, files_dir: str | None = None
    ) -> None:
        self.hf = hf
        self.files_dir = files_dir
        eos_ids = [hf.eos_token_id] if hf.eos_token_id is not None else []
        for token_id in extra_eos_token_ids or []:
            if token_id not in eos_ids:
                eos_ids.append(token_id)
        self.eos_token_ids: list[int] = [int(i) for i in eos_ids]
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)
        #: the ids of the special tokens (``<|im_end|>``, BOS, EOS, ...): control tokens, never text
        self.special_token_ids: frozenset[int] = frozenset(
            int(i) for i, token in hf.added_tokens_decoder.items() if getattr(token, "special", False)
        )
        #: the longest vocabulary entry in characters, an upper bound on the characters one token covers
        #: (byte-level entries spell each byte as one character, so the bound holds for any text)
        self.max_token_chars: int = max((len(token) for token in hf.get_vocab()), default=1)
        fast = getattr(hf, "is_fast", False)
        self._rust: Any = hf.backend_tokenizer if fast else None
        # private copies of the Rust backend (``rust_backend``): one parsing special tokens as HF's encode
        # does, one reading them as plain text
        split = bool(getattr(hf, "split_special_tokens", False))
        self._encoder: Any = private_copy(hf.backend_tokenizer, split) if encodes_generically(hf) else None
        self._plain: Any = private_copy(hf.backend_tokenizer, True) if fast else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Return the token ids of ``text`` (with BOS etc. when ``add_special_tokens``); HF's ids, from the
        Rust backend directly when HF's encode is the generic one. Safe to call from several threads."""
        if self._encoder is not None:
            return encode_ids(self._encoder, text, add_special_tokens)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """:meth:`encode` of each text, in one call to the Rust backend where :meth:`encode` uses it (it
        encodes a batch on all cores)."""
        if self._encoder is not None:
            return encode_ids_many(self._encoder, texts, add_special_tokens)
        return [list(self.hf.encode(text, add_special_tokens=add_special_tokens)) for text in texts]

    def encode_pair(self, first: str, second: str) -> list[int]:
        """The token ids of a text pair as the model's tokenizer joins them (``[CLS] a [SEP] b [SEP]`` for
        BERT): a cross-encoder's input."""
        return list(self.hf(first, second, add_special_tokens=True)["input_ids"])

    def encode_plain(self, text: str) -> list[int]:
        """Return the token ids of ``text`` read as plain text: a special token's string in it
        (``<|im_end|>``) becomes the ids of those characters, never the special token, and no BOS/EOS
        is added. Safe to call from several threads at once."""
        if self._plain is not None:
            return encode_ids(self._plain, text, add_special_tokens=False)
        return list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Return the text of ``ids``.

        A fast tokenizer without the clean-up pass decodes in its Rust backend through the batch call:
        the same text as HF's ``decode``, whose single-text call holds Python's global lock while it runs
        (about 0.1 s for 700,000 ids), whereas the batch call lets other threads run meanwhile.
        """
        if self._rust is not None and not getattr(self.hf, "clean_up_tokenization_spaces", False):
            return self._rust.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def window_decoder(self) -> Any:
        """What incremental detokenizers decode their windows with (``decode(ids, skip_special_tokens=...,
        clean_up_tokenization_spaces=False)``).

        For a fast HF tokenizer this is its Rust tokenizer behind a thin adapter: the same text, since HF's
        fast ``decode`` without the clean-up pass is exactly that call, without HF's per-call argument
        conversion, which cost about six times the decode itself and ran once per token of every stream.
        Any other tokenizer is returned as it is.
        """
        backend = getattr(self.hf, "backend_tokenizer", None) if getattr(self.hf, "is_fast", False) else None
        return self.hf if backend is None else _RustWindowDecoder(backend)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Return the vocabulary strings of ``ids`` (e.g. for logprobs)."""
        return list(self.hf.convert_ids_to_tokens(ids))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render chat ``messages`` to a prompt string with the model's chat template.

        Args:
            messages: dicts with ``role`` (system/user/assistant/tool) and ``content`` (a string or a
                list of ``{"type": "text", "text": ...}`` parts, which are joined).
            add_generation_prompt: end with the header that starts the assistant's turn.
            tools: OpenAI function tools, given to the template as ``tools`` (as HF's own
                ``apply_chat_template`` does); None renders no tools.
            template_kwargs: more variables for the template (``enable_thinking``); the caller keeps
                out names that are HF's own parameters (``engine.chat_tools.check_template_kwargs``).

        Returns:
            The prompt text (special tokens included as text).

        Raises:
            ModelLoadError: the model has no chat template.
            ValueError: a message is malformed.
        """
        if not getattr(self.hf, "chat_template", None):
            raise ModelLoadError("this model has no chat template; use a plain completion prompt instead")
        from jinja2.exceptions import TemplateError, TemplateSyntaxError

        normalized = [normalize_message(message, index) for index, message in enumerate(messages)]
        if not normalized:
            raise ValueError("messages must be a non-empty list")
        try:
            return self.hf.apply_chat_template(
                normalized, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools,
                **(template_kwargs or {}),
            )
        except TemplateSyntaxError:
            raise  # the model's template is broken: not the caller's mistake
        except TemplateError as exc:  # the template's own refusal (``raise_exception``): the caller's mistake
            raise ValueError(str(exc) or "the chat template refused the conversation") from None


class _RustWindowDecoder:
    """``decode`` of a ``tokenizers.Tokenizer`` with HF's signature (see :meth:`Tokenizer.window_decoder`)."""

    __slots__ = ("_backend",)

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def decode(self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("the window decoder never cleans up tokenization spaces")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)


def normalize_message(message: Any, index: int) -> dict[str, Any]:
    """Check one chat message and return a copy whose content is a plain string.

    Raises:
        ValueError: not a dict, missing or unknown role, missing content, or content of the wrong type.
    """
    if not isinstance(message, dict):
        raise ValueError(f"message {index} must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ValueError(f"message {index} has role {role!r}; expected one of {', '.join(CHAT_ROLES)}")
    if "content" not in message:
        raise ValueError(f"message {index} has no 'content'")
    content = message["content"]
    if content is None and role == "assistant" and message.get("tool_calls"):
        content = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] != "text":
                raise ValueError(
                    f"message {index} has a {part['type']!r} content part: this model does not accept "
                    "images, audio or files (it accepts: text)"
                )
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"message {index} has a content part that is not {{'type': 'text', 'text': str}}"
                )
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise ValueError(f"message {index} content must be a string or a list of text parts")
    return {**message, "content": content}


def load_tokenizer(path: str) -> Tokenizer:
    """Load the tokenizer of a HF model folder or a GGUF file.

    Args:
        path: a model folder with tokenizer files, or a ``.gguf`` file with an embedded tokenizer.

    Returns:
        The tokenizer; for folders, ``generation_config.json``'s EOS ids are added to its stop ids.

    Raises:
        ModelLoadError: the path has no usable tokenizer.
    """
    from transformers import AutoTokenizer  # heavy; only needed once a model is really being loaded

    extra_eos: list[int] = []
    files_dir: str | None = None
    try:
        if is_gguf_file(path):
            hf = _load_gguf_tokenizer(path)
            cache = tokenizer_cache_dir(path)
            files_dir = cache if os.path.isfile(os.path.join(cache, "tokenizer_config.json")) else None
        elif os.path.isdir(path):
            hf = AutoTokenizer.from_pretrained(path)
            files_dir = path
            template = folder_chat_template(path, has_template=bool(getattr(hf, "chat_template", None)))
            if template is not None:
                hf.chat_template = template
            gen_path = os.path.join(path, GENERATION_CONFIG_FILE)
            if os.path.isfile(gen_path):
                eos = read_json(gen_path).get("eos_token_id")
                extra_eos = (
                    [int(e) for e in eos] if isinstance(eos, list) else [int(eos)] if eos is not None else []
                )
        else:
            raise ModelLoadError(f"cannot load a tokenizer from {path}: not a model folder or a GGUF file")
    except (OSError, ValueError, KeyError, TypeError) as err:
        if isinstance(err, ModelLoadError):
            raise
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {first_line}") from None
    return Tokenizer(hf, extra_eos, files_dir)


def folder_chat_template(folder: str, has_template: bool) -> str | None:
    """The chat template a model folder's files give, where it differs from what the tokenizer loaded.

    ``chat_template.jinja`` (where transformers 4.43 and later save the template) always wins, whatever
    the installed transformers reads; else, for a tokenizer that loaded none, ``tokenizer_config.json``'s
    ``chat_template`` string, then ``chat_template.json``'s (the processor file of multimodal
    checkpoints). A list of named templates is left to transformers, which picks ``default`` itself.

    Args:
        folder: the model folder.
        has_template: whether the loaded tokenizer already has a chat template.

    Returns:
        The template text to set, or None to keep the tokenizer's.

    Raises:
        ModelLoadError: a file exists but cannot be read, or is not a JSON object.
    """
    jinja = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.isfile(jinja):
        try:
            with open(jinja, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise ModelLoadError(f"cannot read {jinja}: {err}") from None
    if has_template:
        return None
    for name in ("tokenizer_config.json", "chat_template.json"):
        path = os.path.join(folder, name)
        template = read_json(path).get("chat_template") if os.path.isfile(path) else None
        if isinstance(template, str) and template:
            return template
    return None


def tokenizer_cache_dir(gguf_path: str) -> str:
    """Where the HF form of a GGUF file's tokenizer is kept between runs.

    Converting the tokenizer a GGUF file embeds takes seconds (transformers parses the whole file and
    rebuilds the BPE); the saved HF form loads in a fraction of that. The key covers the file's path, size
    and modification time and the transformers version, so a changed file or library is converted anew.
    The root is ``$ENGINE_CACHE_DIR``, else ``~/.cache/engine``.
    """
    import hashlib

    import transformers

    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    root = os.environ.get("ENGINE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "engine")
    return os.path.join(root, "gguf-tokenizers", hashlib.sha256(key.encode()).hexdigest()[:32])


def _load_gguf_tokenizer(path: str) -> Any:
    import shutil
    import tempfile

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cache = tokenizer_cache_dir(path)
    if os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cache)
    folder, name = os.path.dirname(path), os.path.basename(path)
    try:
        hf = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ValueError as err:
        # AutoTokenizer reads the file's model config, which transformers knows for the architectures it
        # models only; the tokenizer converts from the tokenizer.ggml.* keys whatever the architecture
        # (olmo2, olmoe, glm4, granite, command-r, smollm3, ...)
        if "not supported" not in str(err):
            raise
        hf = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(cache))
        hf.save_pretrained(staging)
        try:
            os.replace(staging, cache)  # atomic: a concurrent loader sees all of it or none
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)  # another process stored it first
    except OSError as err:  # an unwritable cache only costs the next start its conversion time
        logger.info("not caching the GGUF tokenizer of %s: %s", path, err)
    return hf
