"""POST /v1/completions/render and /v1/chat/completions/render: prompt token ids, no generation.

vLLM serves these routes, and vllm-router (the router in front of our replicas,
docs/scaling.md) asks a replica for them before routing each request, so its cache-aware
policy sees the tokens the model will see rather than raw text. Without them the router
falls back to `/tokenize` and then to text: two wasted round trips per request.

The body is read and checked exactly as the generation route checks it (same models, same
sampling-parameter validation, same chat template, tools and dialect), so a request that
renders here is one the generation route accepts up to the engine's own checks (context
length, token ids inside the vocabulary). The answer is the part of vLLM's answer that
routers read: `model` and `token_ids`; completions answer one entry per prompt.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from appliance.http.chat import checked_prompt_ids
from appliance.http.completions import prompts_of
from appliance.http.protocol import (
    ChatCompletionRequest,
    CompletionRenderResponse,
    CompletionRequest,
    RenderedPrompt,
)
from appliance.http.serving import begin


async def render_completion(request: Request) -> Response:
    _, state, req, _, _ = await begin(request, CompletionRequest)
    rendered = []
    for prompt in prompts_of(req.prompt):
        if isinstance(prompt, str):
            ids = await state.aeng.offload_if_large(
                len(prompt), state.aeng.tokenizer.encode, prompt
            )
        else:
            ids = list(prompt)
        rendered.append(RenderedPrompt(model=state.model_name, token_ids=ids))
    return JSONResponse(CompletionRenderResponse(rendered).model_dump(mode="json"))


async def render_chat_completion(request: Request) -> Response:
    _, state, req, params, _ = await begin(request, ChatCompletionRequest)
    _, ids = await checked_prompt_ids(state, req, params)
    return JSONResponse(RenderedPrompt(model=state.model_name, token_ids=ids).model_dump())
