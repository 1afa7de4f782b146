"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM serves them.

Same bodies (`{"lora_name", "lora_path"}`, `{"lora_name"}`), same statuses and the same
plain-text success line, so tools written for vLLM's runtime LoRA updates work unchanged;
errors are OpenAI error bodies like every other route's. What is allowed (runtime updates
on, the path under `lora.allowed_dirs`) is decided by `appliance.adapters`; the API keys
are checked before any of it by the middleware that guards every `/v1/` route.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from appliance.adapters import AdapterError
from appliance.http.body import read_json
from appliance.http.errors import from_engine_error
from appliance.http.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from appliance.http.serving import state_of
from engine.errors import EngineError, InvalidRequestError


async def load_lora_adapter(request: Request) -> Response:
    state = state_of(request)
    try:
        state.adapters.require_runtime_updates()  # off: 404 before the body is read
        req = await read_json(
            request, LoadLoRAAdapterRequest, state.server.max_request_body,
            state.server.body_timeout_s,
        )  # fmt: skip
        await state.adapters.load(req.lora_name, req.lora_path)
    except (AdapterError, EngineError, InvalidRequestError) as e:  # dead, shutting down, ...
        raise from_engine_error(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    """Answers once the requests running with the adapter have finished."""
    state = state_of(request)
    try:
        state.adapters.require_runtime_updates()
        req = await read_json(
            request, UnloadLoRAAdapterRequest, state.server.max_request_body,
            state.server.body_timeout_s,
        )  # fmt: skip
        await state.adapters.unload(req.lora_name)
    except (AdapterError, EngineError, InvalidRequestError) as e:
        raise from_engine_error(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
