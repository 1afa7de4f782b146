"""LLMEngine behaviour around the model: validation, stop handling, seeds, abort, beam search."""

from __future__ import annotations

import pytest

from engine import LLM, BeamSearchParams, SamplingParams
from engine.errors import InvalidRequestError
from tests.support.offline import run_to_finals


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(
        str(tiny_llama_dir), num_kv_blocks=128, block_size=4, dtype="float32", max_model_len=256
    )


def _run(llm: LLM, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


def test_text_prompt_and_output_text_decode_tokens(llm):
    out = _run(llm, "The quick brown fox", temperature=0.0, max_tokens=8, ignore_eos=True)
    comp = out.outputs[0]
    assert out.prompt == "The quick brown fox"
    assert out.prompt_token_ids == llm.tokenizer.encode("The quick brown fox")
    assert len(comp.token_ids) == 8
    assert comp.text == llm.tokenizer.decode(comp.token_ids)
    assert comp.finish_reason == "length"


def test_stop_string_truncates_text_and_finishes(llm):
    full = _run(llm, "Once upon a time", temperature=0.0, max_tokens=20, ignore_eos=True)
    text = full.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = _run(
        llm, "Once upon a time", temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]
    )
    comp = out.outputs[0]
    assert comp.finish_reason == "stop"
    assert comp.stop_reason == stop
    assert comp.text == text[: text.index(stop)]
    kept = _run(
        llm, "Once upon a time", temperature=0.0, max_tokens=20, ignore_eos=True,
        stop=[stop], include_stop_str_in_output=True,
    )  # fmt: skip
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_stop_token_id_finishes_with_reason(llm):
    full = _run(llm, "Hello", temperature=0.0, max_tokens=10, ignore_eos=True)
    tok = full.outputs[0].token_ids[4]
    first = full.outputs[0].token_ids.index(tok)
    out = _run(llm, "Hello", temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[tok])
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == tok
    assert out.outputs[0].token_ids == full.outputs[0].token_ids[: first + 1]


def test_same_seed_same_text_regardless_of_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The dragon"], params, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(
        ["Water boils", "The dragon", "A journey"],
        [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), params, params],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone


def test_invalid_requests_name_the_field(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.prepare_request("x", "", SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.prepare_request("x", [1] * 300, SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.prepare_request("x", "hi", SamplingParams(max_tokens=1000))
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.prepare_request("x", [10_000], SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.prepare_request("x", "hi", SamplingParams(logit_bias={99999: 1.0}))
    assert e.value.param == "logit_bias"


def test_abort_frees_blocks_in_any_state(llm):
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    eng.add_request("a", "The quick brown fox jumps", params)
    eng.add_request("b", "Hello there", params)
    eng.step()
    eng.abort("a")
    eng.step()
    eng.abort(["b", "unknown"])
    assert not eng.has_unfinished_requests()
    eng.step()
    assert eng.stats().num_free_blocks == eng.stats().num_blocks


def test_max_tokens_none_runs_to_context_end(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=4, max_model_len=24)
    out = _run(llm, [5, 6, 7, 8], temperature=0.0, max_tokens=None, ignore_eos=True)
    assert len(out.outputs[0].token_ids) == 20
    assert out.outputs[0].finish_reason == "length"


def test_beam_search_width_one_is_greedy(llm):
    greedy = _run(llm, "A language model", temperature=0.0, max_tokens=6, ignore_eos=True)
    beams = llm.beam_search(["A language model"], BeamSearchParams(1, 6, ignore_eos=True))
    assert beams[0].sequences[0].output_token_ids == greedy.outputs[0].token_ids


def test_beam_search_returns_width_sorted_beams_and_frees_blocks(llm):
    res = llm.beam_search(["The earth goes"], BeamSearchParams(3, 5, ignore_eos=True))[0]
    scores = [s.score(1.0) for s in res.sequences]
    assert len(res.sequences) == 3
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(s.output_token_ids) for s in res.sequences}) == 3
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "Hello"}]
    out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(msgs)


def _emitted(llm: LLM, max_tokens: int) -> tuple[int, int, str]:
    """(token ids + logprobs, text characters) in everything `step()` returned for one
    request, and that request's text (the deltas' texts joined)."""
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    eng.add_request("linear", [5, 6, 7], params)
    items = chars = 0
    ids, texts = [], []
    while eng.has_unfinished_requests():
        for out in eng.step():
            for c in out.outputs:
                items += len(c.token_ids) + len(c.logprobs or [])
                chars += len(c.text)
                ids += c.token_ids
                texts.append(c.text)
    assert len(ids) == max_tokens and "".join(texts) == llm.tokenizer.decode(ids)
    return items, chars, "".join(texts)


def test_a_streams_total_output_grows_linearly_with_its_length(llm):
    n = 24
    small_items, small_chars, small_text = _emitted(llm, n)
    big_items, big_chars, big_text = _emitted(llm, 2 * n)
    # Each token id and logprob is returned once: twice the tokens, twice the items (an
    # output copied whole every step would give about four times as many).
    assert (small_items, big_items) == (2 * n, 4 * n)
    # and each character of text once
    assert (small_chars, big_chars) == (len(small_text), len(big_text))


def test_allowed_ids_all_masked_under_min_tokens_are_refused_up_front(llm):
    eos = min(llm.engine.tokenizer.eos_token_ids)
    params = SamplingParams(allowed_token_ids=[eos], min_tokens=3, max_tokens=5)
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.prepare_request("x", "hi", params)
    assert e.value.param == "allowed_token_ids"
    assert "min_tokens=3" in str(e.value)


def test_masks_that_empty_at_run_time_end_the_request_with_an_error_naming_them(llm):
    """A conflict the up-front check did not see (min_tokens set after it) reaches the
    sampler: the request ends with an error naming its masks, no token outside them is
    emitted, its blocks are freed, and the request next to it is untouched."""
    eng = llm.engine
    eos = min(eng.tokenizer.eos_token_ids)
    params = SamplingParams(temperature=0.0, allowed_token_ids=[eos], max_tokens=5, logprobs=0)
    prepared = eng.prepare_request("masked", "Hello", params)
    params.min_tokens = 3
    eng.add_prepared(prepared)
    other = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.add_request("other", "Hello", other)
    finals = run_to_finals(eng, max_steps=50)
    masked = finals["masked"].outputs[0]
    assert masked.finish_reason == "error" and finals["masked"].error is None
    assert "allowed_token_ids" in masked.error.message, masked.error
    assert "min_tokens=3" in masked.error.message and masked.error.param == "allowed_token_ids"
    assert masked.token_ids == []
    assert finals["other"].error is None and len(finals["other"].outputs[0].token_ids) == 4
    assert not eng.has_unfinished_requests()
    assert eng.kv_manager.stats().num_free_blocks == eng.kv_manager.stats().num_blocks


def test_sample_seeds_wrap_inside_int64(llm):
    """A sample's seed is the request's plus its index, wrapped so it stays a valid seed."""
    params = SamplingParams(n=2, seed=2**63 - 1, max_tokens=2)
    prepared = llm.engine.prepare_request("x", "hi", params)
    assert [r.sampling_params.seed for r in prepared.requests] == [2**63 - 1, -(2**63)]
