"""Bodies of POST /v1/embeddings (OpenAI's, with vLLM's extras), as pydantic models.

Strict and closed like the other request models (appliance/http/protocol.py): an unknown
field or a wrong type is a 400 naming it. The response model documents the wire shape in
/openapi.json; the route writes the same shape straight from the engine's vectors.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from appliance.http.protocol import IGNORED, RequestModel, ResponseModel

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(RequestModel):
    input: EmbeddingInput = Field(
        description="A text, a list of texts, token ids, or a list of token-id lists (at most "
        "2048 inputs, and at most scheduler.max_queue_len)."
    )
    model: str | None = Field(None, description="Served model name; defaults to the one model.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: little-endian float32 bytes, as OpenAI sends them."
    )
    dimensions: int | None = Field(
        None,
        description="Keep the first N features, then normalize (models that declare "
        "Matryoshka support only; at most the model's width).",
    )
    user: str | None = Field(None, description=IGNORED)
    # vLLM extras
    truncate_prompt_tokens: int | None = Field(
        None, description="Keep each input's last N tokens; -1: its last max_model_len."
    )
    normalize: bool | None = Field(
        None, description="L2-normalize; null: as the checkpoint declares."
    )
    priority: int = Field(0, description="Lower runs first with scheduler.policy=priority.")


class EmbeddingData(ResponseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str = Field(description="Floats, or base64 with encoding_format.")


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
