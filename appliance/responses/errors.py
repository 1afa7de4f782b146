"""What the Responses pieces raise when a request cannot be served, in no protocol's format:
each frontend maps it (HTTP: an OpenAI error body; gRPC: a status naming the field)."""

from __future__ import annotations


class ResponsesError(ValueError):
    """A request refused: `param` names the field (dotted path), `code` the OpenAI error
    code, `status` the HTTP status it answers with (400, or 404 for what does not exist)."""

    def __init__(
        self, message: str, param: str | None, code: str = "invalid_value", status: int = 400
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


def not_found(message: str, param: str | None, code: str = "not_found") -> ResponsesError:
    return ResponsesError(message, param, code, 404)
