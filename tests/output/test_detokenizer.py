"""Incremental detokenizer and stop strings, on a byte-level BPE and a SentencePiece-style BPE.

Both tokenizers are built offline. Byte-level BPE splits multi-byte characters into byte
tokens; the SentencePiece-style one (Metaspace + byte fallback + Strip, like Llama) drops the
leading space at the start of what it decodes, which is what makes incremental decoding hard.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from engine.output.detokenizer import IncrementalDetokenizer
from engine.output.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams
from tests.support.tiny_models import make_tokenizer

WORDS = ["héllo", "wörld", "你好", "🙂", "The", "quick", "brown", "fox", "Paris", "a", "é"]
SEPARATORS = [" ", " ", " ", "", "\n", ", ", ". "]


def random_text(rng: random.Random, n_words: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(SEPARATORS) for _ in range(n_words))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("bpe")
    make_tokenizer(path)
    return Tokenizer.from_pretrained(path)


def _sentencepiece_tokenizer_json() -> str:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers, trainers

    raw = RawTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    corpus = ["The quick brown fox jumps over the lazy dog. Hello Paris, hello world."] * 4
    raw.train_from_iterator(corpus, trainer=trainer)
    # Llama-style byte fallback: <0x00>..<0xFF> are ordinary vocabulary entries.
    spec = json.loads(raw.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return json.dumps(spec)


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=RawTokenizer.from_str(_sentencepiece_tokenizer_json()),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    path = tmp_path_factory.mktemp("spm")
    hf.save_pretrained(str(path))
    return Tokenizer.from_pretrained(path)


def stream(
    tok: Tokenizer,
    prompt_ids: list[int],
    output_ids: list[int],
    params: SamplingParams | None = None,
    chunks: list[int] | None = None,
) -> tuple[IncrementalDetokenizer, str, str | None]:
    """Feeds output ids (one at a time, or in `chunks`), collecting get_delta() after each.

    Returns the detokenizer, the concatenated deltas and the stop string (if any). Checks on
    the way that no delta ends inside a character.
    """
    detok = IncrementalDetokenizer(tok, prompt_ids, params or SamplingParams())
    sizes = chunks or [1] * len(output_ids)
    streamed, pos, stop = "", 0, None
    for size in sizes:
        stop = detok.update(output_ids[pos : pos + size])
        pos += size
        delta = detok.get_delta()
        assert not delta.endswith("\ufffd") or stop is not None
        streamed += delta
        if stop is not None:
            break
    else:
        stop = detok.flush()
    streamed += detok.get_delta()
    assert streamed == detok.output_text
    return detok, streamed, stop


# ---- incremental decoding -------------------------------------------------------------------


def test_multibyte_characters_split_over_tokens_decode_to_the_full_text(bpe: Tokenizer):
    rng = random.Random(0)
    prompt = bpe.encode("The quick brown fox.")
    for _ in range(40):
        text = random_text(rng, rng.randint(1, 12))
        ids = bpe.encode(text)
        _, streamed, _ = stream(bpe, prompt, ids)
        assert streamed == bpe.decode(ids) == text


def test_random_token_ids_decode_like_tokenizer_decode(bpe: Tokenizer):
    rng = random.Random(1)
    prompt = bpe.encode("hello")
    for _ in range(40):
        ids = [rng.randrange(bpe.vocab_size) for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            params = SamplingParams(skip_special_tokens=skip)
            _, streamed, _ = stream(bpe, prompt, ids, params)
            assert streamed == bpe.decode(ids, skip_special_tokens=skip)


def test_chunked_updates_give_the_same_text(bpe: Tokenizer):
    rng = random.Random(2)
    for _ in range(20):
        ids = bpe.encode(random_text(rng, 10))
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(rng.randint(1, 4))
        _, streamed, _ = stream(bpe, [1], ids, chunks=chunks)
        assert streamed == bpe.decode(ids)


def test_incomplete_character_is_held_back_until_complete(bpe: Tokenizer):
    ids = bpe.encode("a🙂")
    assert len(ids) >= 3  # 'a' plus the emoji's bytes over several tokens
    detok = IncrementalDetokenizer(bpe, [1], SamplingParams())
    detok.update(ids[:1])
    assert detok.get_delta() == "a"
    for tok in ids[1:-1]:
        detok.update([tok])
        assert detok.get_delta() == "" and detok.output_text == "a"
    detok.update(ids[-1:])
    assert detok.get_delta() == "🙂" and detok.output_text == "a🙂"


def test_flush_releases_an_incomplete_character_as_decode_renders_it(bpe: Tokenizer):
    ids = bpe.encode("a🙂")[:-1]
    detok, streamed, stop = stream(bpe, [1], ids)
    assert stop is None and detok.finished
    assert streamed == bpe.decode(ids) and streamed.startswith("a\ufffd")


def test_special_tokens_skipped_or_kept(bpe: Tokenizer):
    ids = bpe.encode("hi") + [2] + bpe.encode(" there") + [0]
    _, kept, _ = stream(bpe, [1], ids, SamplingParams(skip_special_tokens=False))
    assert kept == "hi<|im_end|> there<|endoftext|>"
    _, skipped, _ = stream(bpe, [1], ids)
    assert skipped == "hi there"


def test_sentencepiece_first_token_keeps_its_space_after_a_prompt(spm: Tokenizer):
    prompt = spm.encode("Hello")  # [<s>, ...]
    ids = spm.encode("world", add_special_tokens=False)  # ["▁world"]: decoded alone, "world"
    assert spm.decode(ids) == "world"
    _, streamed, _ = stream(spm, prompt, ids)
    assert streamed == " world"


def test_sentencepiece_text_matches_decode_of_prompt_plus_output(spm: Tokenizer):
    rng = random.Random(3)
    for _ in range(40):
        prompt = spm.encode(random_text(rng, rng.randint(1, 4)).strip())
        ids = spm.encode(" " + random_text(rng, rng.randint(1, 10)), add_special_tokens=False)
        _, streamed, _ = stream(spm, prompt, ids)
        whole = spm.decode(prompt + ids)
        assert streamed == whole[len(spm.decode(prompt)) :]
        # After BOS alone the output decodes exactly as on its own.
        _, alone, _ = stream(spm, [1], ids)
        assert alone == spm.decode(ids)


def test_sentencepiece_byte_fallback_characters_are_not_broken(spm: Tokenizer):
    ids = spm.encode("你好 🙂 wörld", add_special_tokens=False)
    assert sum(spm.hf.convert_ids_to_tokens(i).startswith("<0x") for i in ids) >= 8
    _, streamed, _ = stream(spm, [1], ids)
    assert streamed == "你好 🙂 wörld"


def test_spaces_between_special_tokens(spm: Tokenizer):
    ids = [1] + spm.encode("Hello world", add_special_tokens=False) + [2]
    assert spm.decode(ids, skip_special_tokens=False) == "<s> Hello world</s>"
    assert (
        spm.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)
        == "<s>Hello world</s>"
    )
    for spaces in (True, False):
        params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        _, streamed, _ = stream(spm, [2], ids, params)
        assert streamed == spm.decode(ids, False, spaces)
    # Skipped special tokens do not split the text around them.
    mid = spm.encode("Hello", add_special_tokens=False) + [2]
    mid += spm.encode("world", add_special_tokens=False)
    assert spm.decode(mid, spaces_between_special_tokens=False) == "Hello world"


def test_decoding_window_stays_small(bpe: Tokenizer):
    """O(new tokens) per update: every decode sees a bounded window, not the output."""
    ids = bpe.encode(random_text(random.Random(4), 400))
    detok = IncrementalDetokenizer(bpe, bpe.encode("hello there"), SamplingParams())
    sizes: list[int] = []
    decode = detok.tokenizer.decode

    class Spy:
        def decode(self, window, **kw):
            sizes.append(len(window))
            return decode(window, **kw)

    detok.tokenizer = Spy()
    for tok in ids:
        detok.update([tok])
    assert len(ids) > 500 and max(sizes) <= 12
    assert len(detok._ids) <= 300  # the window's id list is trimmed too


# ---- stop strings ---------------------------------------------------------------------------


def test_stop_string_split_across_tokens(bpe: Tokenizer):
    ids = bpe.encode("The capital of France is Paris.")
    cut = bpe.decode(ids).index("France is")
    pieces = [bpe.decode(ids[: i + 1]) for i in range(len(ids))]
    stop_token = next(i for i, p in enumerate(pieces) if "France is" in p)
    assert "France is" not in bpe.decode([ids[stop_token]])  # really split over tokens
    for include in (False, True):
        params = SamplingParams(stop=["France is"], include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(bpe, [1], params)
        results = [detok.update([t]) for t in ids]
        assert results.index("France is") == stop_token
        assert results[stop_token + 1 :] == [None] * (len(ids) - stop_token - 1)
        expected = "The capital of France is" if include else "The capital of "
        assert detok.output_text == expected == bpe.decode(ids)[: cut + 9 * include]
        assert detok.get_delta() == expected
        assert detok.stop_reason == "France is" and detok.finished


def test_stop_string_inside_one_token_cuts_mid_token(bpe: Tokenizer):
    ids = bpe.encode("Paris is a city")
    _, streamed, stop = stream(bpe, [1], ids, SamplingParams(stop=["ari"]))
    assert (streamed, stop) == ("P", "ari")


def test_earliest_stop_string_wins(bpe: Tokenizer):
    ids = bpe.encode("The quick brown fox jumps over the lazy dog")
    params = SamplingParams(stop=["lazy", "fox", "brown fox jumps"])
    for chunks in ([len(ids)], None):  # all in one update, and token by token
        _, streamed, stop = stream(bpe, [1], ids, params, chunks)
        assert (streamed, stop) == ("The quick brown ", "fox")
    # "Earliest" is the match that completes first, as if text arrived char by char.
    params = SamplingParams(stop=["quick brown fox", "brown"])
    _, streamed, stop = stream(bpe, [1], ids, params, [len(ids)])
    assert (streamed, stop) == ("The quick ", "brown")


def test_stop_string_in_the_prompt_does_not_count(bpe: Tokenizer):
    prompt = bpe.encode("The quick brown fox")
    ids = bpe.encode(" jumps over")
    _, streamed, stop = stream(bpe, prompt, ids, SamplingParams(stop=["fox", "fox jumps"]))
    assert (streamed, stop) == (" jumps over", None)


def test_streaming_holds_back_a_possible_stop_string_then_releases_it(bpe: Tokenizer):
    ids = bpe.encode("Hello Paris is nice")
    detok = IncrementalDetokenizer(bpe, [1], SamplingParams(stop=["Paris!"]))
    streamed = ""
    for tok in ids:
        assert detok.update([tok]) is None
        streamed += detok.get_delta()
        held = detok.output_text[len(streamed) :]
        assert len(held) <= len("Paris!") - 1
        assert "Paris!".startswith(held)
    assert streamed == "Hello Paris is nice"


def test_flush_releases_a_held_back_tail(bpe: Tokenizer):
    ids = bpe.encode("Hello Paris")
    detok, streamed, stop = stream(bpe, [1], ids, SamplingParams(stop=["Paris!"]))
    assert stop is None and streamed == "Hello Paris"


def test_include_stop_str_in_output_holds_nothing_back(bpe: Tokenizer):
    ids = bpe.encode("Hello Paris")
    params = SamplingParams(stop=["Paris!"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(bpe, [1], params)
    for tok in ids:
        detok.update([tok])
    assert detok.get_delta() == "Hello Paris"


def test_stop_strings_ignored_until_min_tokens(bpe: Tokenizer):
    ids = bpe.encode("fox fox fox")
    first_fox = next(i + 1 for i in range(len(ids)) if "fox" in bpe.decode(ids[: i + 1]))
    _, streamed, stop = stream(bpe, [1], ids, SamplingParams(stop=["fox"]))
    assert (streamed, stop) == ("", "fox")
    params = SamplingParams(stop=["fox"], min_tokens=first_fox)
    _, streamed, stop = stream(bpe, [1], ids, params)
    assert (streamed, stop) == ("fox ", "fox")


def test_updates_after_a_stop_add_no_text(bpe: Tokenizer):
    detok = IncrementalDetokenizer(bpe, [1], SamplingParams(stop=["b"]))
    assert detok.update(bpe.encode("ab")) == "b"
    assert detok.update(bpe.encode("cd")) is None
    assert detok.flush() is None
    assert detok.output_text == "a"


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The stop semantics on the whole text: the match that ends first (longest on a tie)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (
            best is None or (i + len(s), -len(s)) < (best[0] + len(best[1]), -len(best[1]))
        ):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[: i + len(s) * include], s


def test_stop_strings_match_the_whole_text_reference(bpe: Tokenizer):
    rng = random.Random(5)
    for case in range(150):
        text = random_text(rng, rng.randint(2, 10))
        ids = bpe.encode(text)
        full = bpe.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.7:
                a = rng.randrange(len(full))
                stops.append(full[a : a + rng.randint(1, 6)])
            else:
                stops.append(rng.choice(["zz", "fox!", "你好🙂", "\n\n"]))
        include = case % 2 == 1
        chunks = None if case % 3 else [rng.randint(1, 3) for _ in ids]
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        _, streamed, stop = stream(bpe, [1], ids, params, chunks)
        assert (streamed, stop) == _reference(full, stops, include), (full, stops, include)


def _held_reference(pending: str, stops: list[str]) -> int:
    """Brute force: the longest tail of `pending` that is a proper prefix of a stop string."""
    return max(
        (
            k
            for s in stops
            for k in range(1, min(len(s), len(pending) + 1))
            if pending.endswith(s[:k])
        ),
        default=0,
    )


def test_held_back_text_matches_a_brute_force_reference_at_every_step(bpe: Tokenizer):
    """Overlapping, self-similar stop strings over a two-letter text: after each update the
    text held back is exactly the longest tail that could still start a stop string."""
    rng = random.Random(19)
    for case in range(120):
        text = "".join(rng.choice("ab é") for _ in range(rng.randint(5, 40)))
        ids = bpe.encode(text)
        stops = ["".join(rng.choice("ab é") for _ in range(rng.randint(1, 9))) for _ in range(3)]
        min_tokens = rng.choice([0, 0, len(ids) // 2])
        params = SamplingParams(stop=stops, min_tokens=min_tokens, max_tokens=None)
        detok = IncrementalDetokenizer(bpe, [1], params)
        streamed = ""
        for tok in ids:
            stop = detok.update([tok])
            pending = detok.output_text[len(streamed) :]  # not returned yet
            streamed += detok.get_delta()
            if stop is not None:
                break
            assert detok.output_text.startswith(streamed), (text, stops)
            held = len(detok.output_text) - len(streamed)
            assert held == _held_reference(pending, stops), (text, stops, case)
        if detok.stop_reason is None:
            detok.flush()
        streamed += detok.get_delta()
        assert streamed == detok.output_text


def _own_chars(detok: IncrementalDetokenizer, shared: list[object]) -> int:
    """Characters a detokenizer stores itself: every str reachable from its attributes
    (through lists, tuples, sets and dicts), each object once, minus the `shared` ones."""
    skip = {id(o) for o in shared} | {id(detok.tokenizer)}
    seen: set[int] = set()
    todo: list[object] = list(vars(detok).values())
    total = 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or id(obj) in skip:
            continue
        seen.add(id(obj))
        if isinstance(obj, str):
            total += len(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            todo.extend(obj)
    return total


def test_a_long_stop_string_costs_memory_linear_in_its_length(bpe: Tokenizer):
    """Finding 1 of issue 19: every proper prefix of every stop string was kept in a set,
    L^2/2 characters per string and sample (8M for this one; 450M for 30,000 characters).
    Now a sample stores the held-back tail and the last (longest stop - 1) characters;
    the stop strings themselves are the request's, shared by all its samples."""
    length = 4000
    stop = "Paris" + "x" * (length - 5)
    params = SamplingParams(stop=[stop, "fox"], n=2, max_tokens=None)
    samples = [replace(params, n=1, seed=i) for i in range(2)]
    ids = bpe.encode("Hello Paris " * 40)
    detoks = [IncrementalDetokenizer(bpe, [1], p) for p in samples]
    for detok in detoks:
        for tok in ids:
            assert detok.update([tok]) is None
            detok.get_delta()
        assert detok.stop[0] is params.stop[0]  # the request's string, not a copy
        own = _own_chars(detok, list(params.stop))
        assert own <= 2 * length + 2 * len(detok.output_text), own


def test_prompt_tail_starting_inside_a_character_does_not_leak_into_the_output(bpe: Tokenizer):
    ids = bpe.encode(" héllo 你好")
    for cut in range(1, 12):
        prompt = bpe.encode("你好🙂你好")[:cut]
        for skip in (True, False):
            params = SamplingParams(skip_special_tokens=skip)
            _, streamed, _ = stream(bpe, [1, *prompt, 2], ids, params)
            assert streamed == " héllo 你好"
