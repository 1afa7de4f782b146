"""How a generation's end becomes a Response's `status`, `incomplete_details` and `error`: the
one place that maps engine outcomes to the Responses API (streamed and not, HTTP and gRPC).

    finish stop                      -> completed
    finish length                    -> incomplete, reason max_output_tokens
    finish error, or the engine
      failing the request            -> failed; error.code invalid_prompt when the request
                                        itself could not be satisfied (a grammar or mask that
                                        leaves no token: the engine's InvalidRequestError),
                                        else server_error
A non-streamed failure is also answered with the HTTP status chat completions gives the
same engine error (400 or 500); streamed, it is a `response.failed` event.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.responses.protocol import IncompleteDetails, ResponseError
from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class Outcome:
    status: str  # completed | incomplete | failed
    incomplete: IncompleteDetails | None = None
    error: ResponseError | None = None

    @property
    def terminal_event(self) -> str:
        return {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed"}[self.status]  # fmt: skip


def outcome_of(
    finish_reason: str | None, failure: BaseException | None, error_text: str | None = None
) -> Outcome:
    """The outcome of a sample that ended with `finish_reason`, or of a request the engine
    failed with `failure` (then `finish_reason` is irrelevant). `error_text`: the engine's
    message for a sample that finished with reason "error"."""
    if failure is not None:
        code = "invalid_prompt" if isinstance(failure, InvalidRequestError) else "server_error"
        return Outcome("failed", error=ResponseError(code=code, message=str(failure)))
    if finish_reason == "error":
        return Outcome(
            "failed", error=ResponseError(code="server_error", message=error_text or "failed")
        )
    if finish_reason == "length":
        return Outcome("incomplete", incomplete=IncompleteDetails(reason="max_output_tokens"))
    return Outcome("completed")
