"""Scoring prompts over HTTP: `echo` with `logprobs`, `max_tokens: 0` and `prompt_logprobs`
on /v1/completions, as eval harnesses send them, checked against transformers' log-softmax
on the same tiny fp32 checkpoint.

lm-evaluation-harness's `local-completions` model scores a (context, continuation) pair by
sending the tokens of context + continuation with `echo: true, logprobs: 1, temperature: 0`
in batches, and reading `token_logprobs` / `top_logprobs` from the context's length on:
`max_tokens: 1` and `[ctxlen:-1]` in current releases, `max_tokens: 0` and `[ctxlen:]` in
older ones. `_lm_eval_parse` below is that client's computation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import torch

from appliance.config import ServerConfig
from appliance.http.app import build_app
from appliance.http.server import BackgroundServer
from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
from tests.support.waiting import wait_for

# (context, continuation) token ids; the continuations of the last pair are filled in with
# the model's own greedy tokens, so exactly that pair is greedy.
PAIRS = [
    ([17, 302, 45, 9, 250], [33, 71]),
    ([120, 8, 64, 199, 5, 77, 310, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [310]),
    ([5, 6, 7, 8, 9, 10], []),
]


@dataclass
class Served:
    url: str
    aeng: AsyncEngine


@pytest.fixture(scope="module")
def served(tiny_llama_dir) -> Iterator[Served]:
    cfg = EngineConfig(
        model=ModelConfig(path=str(tiny_llama_dir), served_name="tiny", max_model_len=128),
        cache=CacheConfig(block_size=4, num_kv_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8),  # chunked
        runtime=RuntimeConfig(device="cpu", num_threads=1),
    )
    aeng = AsyncEngine.from_config(cfg)
    with BackgroundServer(build_app(aeng, ServerConfig())) as srv:
        yield Served(srv.url, aeng)
    import asyncio

    asyncio.run(aeng.shutdown())


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)


def _log_softmax(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def pairs(hf) -> list[tuple[list[int], list[int]]]:
    ctx = PAIRS[2][0]
    greedy: list[int] = []
    for _ in range(3):
        greedy.append(int(_log_softmax(hf, ctx + greedy)[-1].argmax()))
    return [*PAIRS[:2], (ctx, greedy)]


def _reference(hf, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """What a harness should get: log P(cont | ctx) and whether cont is the greedy path."""
    logp = _log_softmax(hf, ctx + cont)
    rows = logp[len(ctx) - 1 : len(ctx) + len(cont) - 1]
    total = sum(rows[i, t].item() for i, t in enumerate(cont))
    return total, all(int(rows[i].argmax()) == t for i, t in enumerate(cont))


def _lm_eval_parse(body: dict, ctxlens: list[int], tail: int) -> list[tuple[float, bool]]:
    """lm-eval's `parse_logprobs`: sum of token_logprobs over the continuation, and whether
    each of its tokens had the top logprob; `tail` trailing generated entries are cut."""
    res = []
    for choice, ctxlen in zip(
        sorted(body["choices"], key=lambda c: c["index"]), ctxlens, strict=True
    ):
        lps = choice["logprobs"]
        end = len(lps["token_logprobs"]) - tail
        token_lps = lps["token_logprobs"][ctxlen:end]
        tops = lps["top_logprobs"][ctxlen:end]
        res.append(
            (
                sum(token_lps),
                all(t == max(top.values()) for t, top in zip(token_lps, tops, strict=True)),
            )
        )
    return res


def _post(served: Served, body: dict) -> httpx.Response:
    return httpx.post(f"{served.url}/v1/completions", json={"model": "tiny", **body}, timeout=60)


def _idle_and_free(served: Served) -> None:
    def done() -> bool:
        s = served.aeng.stats()
        return s.num_running == 0 and s.num_waiting == 0 and s.kv_usage == 0

    wait_for(done, "engine idle with every KV block free")


@pytest.mark.parametrize("max_tokens, tail", [(1, 1), (0, 0)], ids=["current", "legacy"])
def test_lm_eval_loglikelihood_batch_matches_transformers(served, hf, pairs, max_tokens, tail):
    prompts = [ctx + cont for ctx, cont in pairs]
    r = _post(
        served,
        {"prompt": prompts, "echo": True, "max_tokens": max_tokens, "logprobs": 1,
         "temperature": 0, "seed": 1234},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    got = _lm_eval_parse(body, [len(ctx) for ctx, _ in pairs], tail)
    for (ctx, cont), (total, greedy) in zip(pairs, got, strict=True):
        ref_total, ref_greedy = _reference(hf, ctx, cont)
        assert total == pytest.approx(ref_total, abs=1e-4)
        assert greedy == ref_greedy
    assert [g for _, g in got] == [False, False, True]
    for choice, prompt in zip(body["choices"], prompts, strict=True):
        lps = choice["logprobs"]
        assert len(lps["tokens"]) == len(prompt) + max_tokens
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == max_tokens * len(prompts)
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    _idle_and_free(served)


def test_echo_text_prompt_returns_prompt_then_completion(served, hf):
    ids = httpx.post(f"{served.url}/tokenize", json={"prompt": "The dragon"}).json()["tokens"]
    r = _post(
        served,
        {"prompt": "The dragon", "echo": True, "max_tokens": 2, "logprobs": 2,
         "temperature": 0, "ignore_eos": True},
    ).json()  # fmt: skip
    choice = r["choices"][0]
    plain = _post(
        served,
        {"prompt": "The dragon", "max_tokens": 2, "logprobs": 2, "temperature": 0,
         "ignore_eos": True},
    ).json()["choices"][0]  # fmt: skip
    assert choice["text"] == "The dragon" + plain["text"]
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(ids) + 2
    assert lps["tokens"][len(ids) :] == plain["logprobs"]["tokens"]
    assert lps["token_logprobs"][len(ids) :] == plain["logprobs"]["token_logprobs"]
    assert lps["text_offset"][0] == 0 and lps["text_offset"][len(ids)] == len("The dragon")
    logp = _log_softmax(hf, ids)
    for pos in range(1, len(ids)):
        assert lps["token_logprobs"][pos] == pytest.approx(logp[pos - 1, ids[pos]].item(), abs=1e-4)
        assert 1 <= len(lps["top_logprobs"][pos]) <= 3


def test_echo_with_max_tokens_zero_and_no_logprobs_echoes_the_prompt(served):
    r = _post(served, {"prompt": ["Once upon", "a time"], "echo": True, "max_tokens": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["text"] for c in body["choices"]] == ["Once upon", "a time"]
    assert all(c["logprobs"] is None and c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 0


def test_streamed_echo_with_max_tokens_zero_sends_the_prompt_then_length(served):
    body = {"model": "tiny", "prompt": "Once upon", "echo": True, "max_tokens": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [c for e in events[:-1] for c in json.loads(e)["choices"]]
    assert "".join(c["text"] for c in choices) == "Once upon"
    assert [c["finish_reason"] for c in choices if c.get("finish_reason")] == ["length"]


def test_prompt_logprobs_in_vllm_shape(served, hf):
    prompt = PAIRS[1][0]
    r = _post(served, {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert choice["logprobs"] is None and len(plp) == len(prompt) and plp[0] is None
    logp = _log_softmax(hf, prompt)
    for pos in range(1, len(prompt)):
        entry = plp[pos]
        tok = entry[str(prompt[pos])]  # the prompt token itself, whatever its rank
        assert tok["logprob"] == pytest.approx(logp[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert tok["rank"] == 1 + int((logp[pos - 1] > logp[pos - 1, prompt[pos]]).sum())
        assert isinstance(tok["decoded_token"], str)
        top2 = logp[pos - 1].topk(2).indices.tolist()
        assert set(entry) == {str(prompt[pos]), *map(str, top2)}
        assert [entry[str(t)]["rank"] for t in top2] == [1, 2]


def test_plain_completions_say_prompt_logprobs_null(served):
    choice = _post(served, {"prompt": "hi", "max_tokens": 1}).json()["choices"][0]
    assert choice["prompt_logprobs"] is None
