"""Tokenizer wrapper: local loading, EOS ids, encode/decode, chat template errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.output.tokenizer import Tokenizer
from tests.support.tiny_models import CHATML_TEMPLATE, TOKENIZER_VOCAB_SIZE, make_tokenizer

TEXT = "héllo wörld 你好 🙂 The quick brown fox."


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tok_dir)


def _copy_tokenizer(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_loads_locally_with_vocab_size_and_eos(tok: Tokenizer):
    assert tok.vocab_size == TOKENIZER_VOCAB_SIZE == len(tok.hf)
    assert tok.eos_token_ids == {0}
    assert tok.eos_token_id == 0


@pytest.mark.parametrize("eos", [2, [1, 2]])
def test_eos_ids_include_generation_config(tok_dir: Path, tmp_path: Path, eos):
    d = _copy_tokenizer(tok_dir, tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    expected = {0} | ({eos} if isinstance(eos, int) else set(eos))
    assert Tokenizer.from_pretrained(d).eos_token_ids == expected


def test_missing_directory_is_a_clear_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        Tokenizer.from_pretrained(tmp_path / "nope")


def test_encode_decode_round_trip_with_multibyte_text(tok: Tokenizer):
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    # Multi-byte characters really are split over several byte-level tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_decode_skips_special_tokens_only_when_asked(tok: Tokenizer):
    ids = [1] + tok.encode("hi", add_special_tokens=False) + [2, 0]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|><|endoftext|>"


def test_spaces_between_special_tokens_false_keeps_byte_level_text(tok: Tokenizer):
    ids = [1] + tok.encode(" hi there", add_special_tokens=False) + [2]
    for skip in (True, False):
        assert tok.decode(ids, skip, spaces_between_special_tokens=False) == tok.decode(ids, skip)


def test_chat_template_matches_transformers(tok: Tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    ids = tok.apply_chat_template(messages)
    expected = tok.hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(expected)
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[: len(no_prompt)] == no_prompt and len(no_prompt) < len(ids)
    assert tok.has_chat_template()


def test_text_content_parts_are_joined(tok: Tokenizer):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    joined = tok.apply_chat_template([{"role": "user", "content": parts}])
    assert joined == tok.apply_chat_template([{"role": "user", "content": "Hello\nthere"}])


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\]: must be an object"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user"}], r"messages\[0\]\.content: required"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content: must be a string"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "only text parts",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\]\.text"),
    ],
)
def test_malformed_messages_raise_value_error(tok: Tokenizer, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_missing_chat_template_raises_value_error(tok_dir: Path, tmp_path: Path):
    d = _copy_tokenizer(tok_dir, tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in d.glob("chat_template.*"):
        f.unlink()
    t = Tokenizer.from_pretrained(d)
    assert not t.has_chat_template()
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_exceptions_become_value_errors(tok: Tokenizer):
    strict = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation must start with a user turn') }}{% endif %}"
        + CHATML_TEMPLATE
    )
    original = tok.hf.chat_template
    tok.hf.chat_template = strict
    try:
        with pytest.raises(ValueError, match="must start with a user turn"):
            tok.apply_chat_template([{"role": "assistant", "content": "hi"}])
    finally:
        tok.hf.chat_template = original


def test_tools_and_extra_kwargs_reach_the_template(tok: Tokenizer):
    template = (
        "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
        "{% if shout %}!{% endif %}" + CHATML_TEMPLATE
    )
    original = tok.hf.chat_template
    tok.hf.chat_template = template
    try:
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
        msgs = [{"role": "user", "content": "hi"}]
        text = tok.render_chat_template(msgs, tools=tools, shout=True)
        assert text.startswith("[lookup]!<|im_start|>user\nhi")
        assert tok.apply_chat_template(msgs, tools=tools, shout=True) == tok.encode(
            text, add_special_tokens=False
        )
    finally:
        tok.hf.chat_template = original


def test_assistant_message_with_only_tool_calls_is_accepted(tok: Tokenizer):
    template = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] or 'CALL' }};{% endfor %}"
    original = tok.hf.chat_template
    tok.hf.chat_template = template
    try:
        msgs = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        ]
        assert tok.render_chat_template(msgs, add_generation_prompt=False) == (
            "user:hi;assistant:CALL;"
        )
    finally:
        tok.hf.chat_template = original


def test_raw_decode_fast_path_equals_transformers_decode(tiny_checkpoint):
    """The Rust-level decode shortcut gives exactly what transformers' decode gives."""
    import random

    for d in [tiny_checkpoint("llama")]:
        tok = Tokenizer.from_pretrained(d)
        assert tok._raw_decode is not None, d
        rng = random.Random(0)
        specials = sorted(tok._special_ids)
        for _ in range(300):
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 12))]
            if specials and rng.random() < 0.3:
                ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(
                    ids, skip_special_tokens=skip
                )
