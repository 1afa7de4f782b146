"""Speculative decoding served over HTTP: streamed greedy text equals the offline output
without speculation, a storm of concurrent streams (some clients leaving mid-stream) under
a tight KV pool leaves no block held once idle, and /metrics carries vLLM's
`vllm:spec_decode_*` counters with the engine's numbers; the request's trace attributes
carry its mean acceptance length."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
from prometheus_client.parser import text_string_to_metric_families

from appliance.telemetry import request_attributes
from engine import LLM, SamplingParams
from engine.config import SpeculativeConfig
from tests.support.served_stack import served, tiny_engine, wait_idle_and_free
from tests.support.waiting import HANG_S

SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
MAX_TOKENS = 30


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(3, 10))] for _ in range(16)]


async def _stream(client: httpx.AsyncClient, prompt: list[int], leave_after: int | None) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    text, chunks = "", 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text += json.loads(line[6:])["choices"][0]["text"]
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return ""  # the client leaves mid-stream: the request is aborted
    return text


def test_served_speculation_streams_the_same_text_and_leaves_nothing_held(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama", weight_std=0.05)
    prompts = _prompts()
    offline = LLM(str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=256,
                  block_size=4)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]  # fmt: skip
    engine = tiny_engine(model_dir, num_kv_blocks=40, block_size=4, speculative=SPEC)
    with served(engine) as stack:

        async def storm():
            async with httpx.AsyncClient(base_url=stack.url, timeout=HANG_S) as c:
                leave = [2 if i % 4 == 3 else None for i in range(len(prompts))]
                return await asyncio.gather(
                    *(_stream(c, p, n) for p, n in zip(prompts, leave, strict=True))
                )

        texts = asyncio.run(storm())
        for i, (got, want) in enumerate(zip(texts, expected, strict=True)):
            if i % 4 != 3:
                assert got == want, i
        wait_idle_and_free(stack.aeng)
        stats = stack.aeng.stats()
        spec = stats.spec_decode
        assert spec.num_draft_tokens > spec.num_accepted_tokens > 0
        assert stats.num_preemptions > 0
        text = httpx.get(stack.url + "/metrics", timeout=HANG_S).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name, value in (("num_drafts", spec.num_drafts),
                        ("num_draft_tokens", spec.num_draft_tokens),
                        ("num_accepted_tokens", spec.num_accepted_tokens)):  # fmt: skip
        [sample] = [
            s for s in fams[f"vllm:spec_decode_{name}"].samples if s.name.endswith("_total")
        ]
        assert sample.labels == {"model_name": "tiny"} and sample.value == value, name
    per_pos = {
        s.labels["position"]: s.value
        for s in fams["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
        if s.name.endswith("_total")
    }
    assert per_pos["0"] == spec.accepted_per_pos[0] > 0
    assert sum(per_pos.values()) == spec.num_accepted_tokens


def test_the_request_span_carries_its_mean_acceptance_length(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama", weight_std=0.05)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=256,
              block_size=4, speculative_config=SPEC)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": _prompts()[0]}], params, use_tqdm=False)
    m = out.metrics
    assert m.spec_num_drafts > 0 and m.spec_num_accepted_tokens > 0
    attrs = request_attributes(out, operation="text_completion", model="tiny", params=params)
    assert attrs["appliance.spec_decode.mean_acceptance_length"] == (
        1 + m.spec_num_accepted_tokens / m.spec_num_drafts
    )
    assert attrs["appliance.spec_decode.num_draft_tokens"] == m.spec_num_draft_tokens
