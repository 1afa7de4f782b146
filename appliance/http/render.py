"""POST /v1/completions/render and /v1/chat/completions/render: prompt token ids, no generation.

vLLM serves these routes, and vllm-router (the router in front of our replicas,
docs/scaling.md) asks a replica for them before routing each request, so its cache-aware
policy sees the tokens the model will see rather than raw text. Without them the router
falls back to `/tokenize` and then to text: two wasted round trips per request.

The body is read and checked exactly as the generation route checks it (same models, same
sampling-parameter validation, same chat template, tools and dialect, and the engine's own
checks: token ids inside the vocabulary, the context length, the constraint compiled), so
a request renders here exactly when the generation route would accept it. The answer is
the part of vLLM's answer that routers read: `model` and `token_ids`; completions answer
one entry per prompt.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.http import convert
from appliance.http.chat import checked_prompt_ids
from appliance.http.completions import prompts_of
from appliance.http.protocol import (
    ChatCompletionRequest,
    CompletionRenderResponse,
    CompletionRequest,
    RenderedPrompt,
)
from appliance.http.serving import Begun, begin


async def render_completion(request: Request) -> Response:
    begun = await begin(request, CompletionRequest)
    ids = await _validated_ids(begun, prompts_of(begun.req.prompt))
    rendered = [RenderedPrompt(model=begun.state.model_name, token_ids=t) for t in ids]
    return JSONResponse(CompletionRenderResponse(rendered).model_dump(mode="json"))


async def render_chat_completion(request: Request) -> Response:
    begun = await begin(request, ChatCompletionRequest)
    state, req = begun.state, begun.req
    _, prompt_ids = await begun.offload(checked_prompt_ids, state, req, begun.params)
    (ids,) = await _validated_ids(begun, [prompt_ids])
    return JSONResponse(RenderedPrompt(model=state.model_name, token_ids=ids).model_dump())


async def _validated_ids(begun: Begun, prompts: list) -> list[list[int]]:
    """Each prompt's token ids after the engine's own checks, the generation route's: the
    one validation both share (`AsyncEngine.prepare_requests`: token ids inside the
    vocabulary, the context length, the adapter, the constraint compiled), nothing queued."""
    req = begun.req
    try:
        prepared = await begun.state.aeng.prepare_requests(
            prompts, begun.params, [f"render-{i}" for i in range(len(prompts))],
            lora_request=begun.lora, input_size=begun.size,
        )  # fmt: skip
    except Exception as e:
        raise convert.client_error(e, lambda p: convert.engine_param(p, req)) from None
    return [p.prompt_token_ids for p in prepared]
