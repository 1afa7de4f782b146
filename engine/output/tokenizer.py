"""The engine's view of a Hugging Face tokenizer: encode, decode, chat template, EOS ids.

transformers does the tokenizing and template rendering; this wrapper pins the few choices
the engine depends on (local files only, the full set of EOS ids, chat messages checked
before rendering so a bad request is a `ValueError` and not a Jinja traceback).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

_ROLES_NEED_NO_CONTENT = {"assistant"}  # an assistant turn may carry only tool_calls


class Tokenizer:
    """Wraps a transformers tokenizer (`hf`) loaded from a local checkpoint directory."""

    def __init__(self, hf: Any, eos_token_ids: Iterable[int] = ()):
        self.hf = hf
        self.vocab_size: int = len(hf)
        ids = set(eos_token_ids)
        if hf.eos_token_id is not None:
            ids.add(int(hf.eos_token_id))
        self.eos_token_ids: set[int] = ids
        # Added tokens (special or not) render as their literal content; kept for
        # spaces_between_special_tokens=False, which decodes the text between them apart.
        self._added_tokens: dict[int, str] = {
            int(i): tok.content for i, tok in hf.added_tokens_decoder.items()
        }
        self._special_ids: frozenset[int] = frozenset(hf.all_special_ids)
        self._raw_decode = _raw_decoder(hf)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Loads the tokenizer in `model_dir` (never the network) and its EOS ids.

        EOS ids are the tokenizer's eos token plus `eos_token_id` (an int or a list) from
        generation_config.json: chat models often end turns with a token (`<|im_end|>`,
        `<|eot_id|>`) that is only listed there.
        """
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"tokenizer: {model_dir} is not a directory")
        hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        return cls(hf, _generation_config_eos(model_dir))

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own eos token (one id), for APIs that take a single id."""
        return self.hf.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """Text of `ids`.

        spaces_between_special_tokens=True is the tokenizer's own decode. False decodes the
        text between rendered added tokens separately and joins everything with nothing in
        between, so a SentencePiece decoder adds no space after e.g. `<s>` (the slow-tokenizer
        behaviour vLLM exposes). It only matters when added tokens are rendered.
        """
        if spaces_between_special_tokens or not self._added_tokens:
            if self._raw_decode is not None:
                return self._raw_decode(ids, skip_special_tokens=skip_special_tokens)
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        parts: list[str] = []
        segment: list[int] = []
        for tok in ids:
            content = self._added_tokens.get(tok)
            if content is None:
                segment.append(tok)
            elif skip_special_tokens and tok in self._special_ids:
                continue  # dropped, and does not split the text around it
            else:
                if segment:
                    parts.append(self.hf.decode(segment, skip_special_tokens=skip_special_tokens))
                    segment = []
                parts.append(content)
        if segment:
            parts.append(self.hf.decode(segment, skip_special_tokens=skip_special_tokens))
        return "".join(parts)

    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation, ready to be a prompt.

        Extra kwargs reach the template (e.g. `enable_thinking`, `continue_final_message`).
        Raises ValueError when there is no template, the messages are malformed, or the
        template itself rejects them (`raise_exception` in Jinja).
        """
        text = self.render_chat_template(messages, add_generation_prompt, tools, **kwargs)
        # The template writes BOS and friends itself; adding them again would double them.
        return self.encode(text, add_special_tokens=False)

    def render_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """The rendered conversation as text (what `apply_chat_template` tokenizes)."""
        if not self.has_chat_template():
            raise ValueError(
                "messages: this model's tokenizer has no chat template; "
                "use a completion prompt instead"
            )
        normalized = _normalize_messages(messages)
        try:
            text = self.hf.apply_chat_template(
                normalized,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
        except ValueError:
            raise
        except Exception as e:  # jinja2.TemplateError, TypeError from a template expression
            raise ValueError(f"messages: the chat template rejected them: {e}") from e
        if not isinstance(text, str):
            raise ValueError("messages: the chat template did not render to text")
        return text


def _generation_config_eos(model_dir: Path) -> set[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return set()
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def _normalize_messages(messages: Any) -> list[dict]:
    """Checks chat messages and flattens text-only content parts to one string.

    OpenAI clients may send `content` as a list of `{"type": "text", "text": ...}` parts;
    most chat templates only handle a string, and this engine only handles text, so the
    parts are joined with newlines (as vLLM does for string-format templates).
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of {role, content} objects")
    out: list[dict] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where}: must be an object with 'role' and 'content'")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}.role: must be a non-empty string")
        msg = dict(msg)
        content = msg.get("content")
        if content is None:
            if role not in _ROLES_NEED_NO_CONTENT or not msg.get("tool_calls"):
                raise ValueError(f"{where}.content: required for role {role!r}")
        elif isinstance(content, list):
            msg["content"] = _join_text_parts(content, where)
        elif not isinstance(content, str):
            raise ValueError(f"{where}.content: must be a string or a list of text parts")
        out.append(msg)
    return out


def _join_text_parts(parts: list, where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"{where}.content[{j}]: only text parts are supported (got {kind!r})")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}.content[{j}].text: must be a string")
        texts.append(text)
    return "\n".join(texts)


def _raw_decoder(hf: Any):
    """The Rust tokenizer's own `decode`, when transformers' `decode` would add nothing to it.

    The detokenizer decodes twice per sequence per step, and transformers' wrapper (argument
    conversion, kwargs plumbing) costs more than the decode itself: about 40 µs per call
    here, most of a 256-request step's output processing. It adds nothing when the
    tokenizer is a fast one whose `_decode` is the stock one and no clean-up of
    tokenization spaces is configured; otherwise None, and `hf.decode` is used.
    """
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    backend = getattr(hf, "_tokenizer", None)
    if (
        not isinstance(hf, PreTrainedTokenizerFast)
        or type(hf)._decode is not PreTrainedTokenizerFast._decode
        or getattr(hf, "clean_up_tokenization_spaces", False)
        or not hasattr(backend, "decode")
    ):
        return None
    return backend.decode
