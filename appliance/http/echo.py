"""The prompt side of a /v1/completions answer: `echo` with `logprobs`, and `prompt_logprobs`.

This is how eval harnesses (lm-evaluation-harness's `local-completions`, ...) score
multiple-choice answers: they send `echo: true, logprobs: k` with `max_tokens` 0 or 1 and
sum `token_logprobs` over the continuation's tokens. With echo, the legacy `logprobs`
object covers the prompt tokens first (the first one has nothing to be predicted from, so
its `token_logprobs` and `top_logprobs` entries are null), then the generated ones.
`prompt_logprobs` (a vLLM extra) gives the same numbers in vLLM's shape instead: per prompt
token (first null) a map from token id, as a string, to `{logprob, rank, decoded_token}`.

Pure functions of an engine `RequestOutput` (no I/O). Which
requests get prompt logprobs from the engine is decided in `convert._prompt_logprobs`.
"""

from __future__ import annotations

from appliance.http.convert import TokenStr, completion_logprobs, json_logprob
from appliance.http.protocol import CompletionLogprobs, CompletionRequest, PromptLogprob
from engine.output.request_output import CompletionOutput, RequestOutput


def choice_logprobs(
    req: CompletionRequest,
    out: RequestOutput,
    comp: CompletionOutput,
    prompt_text: str,
    token_str: TokenStr,
) -> CompletionLogprobs | None:
    """A choice's legacy `logprobs`: the generated tokens, after the prompt's with echo.

    The generated tokens' offsets start at the end of the echoed prompt text."""
    if req.logprobs is None or comp.logprobs is None:
        return None
    if not req.echo:
        return completion_logprobs(comp.logprobs, req.logprobs, token_str, 0)
    if out.prompt_logprobs is None:  # the engine was asked for them: see convert
        raise RuntimeError("echo with logprobs needs the engine's prompt logprobs")
    ids = out.prompt_token_ids
    first = token_str(ids[0])
    scored = completion_logprobs(
        [lp for lp in out.prompt_logprobs[1:] if lp is not None], req.logprobs, token_str,
        len(first),
    )  # fmt: skip
    gen = completion_logprobs(comp.logprobs, req.logprobs, token_str, len(prompt_text))
    return CompletionLogprobs(
        tokens=[first, *scored.tokens, *gen.tokens],
        token_logprobs=[None, *scored.token_logprobs, *gen.token_logprobs],
        top_logprobs=[None, *scored.top_logprobs, *gen.top_logprobs],
        text_offset=[0, *scored.text_offset, *gen.text_offset],
    )


def prompt_logprobs_field(
    req: CompletionRequest, out: RequestOutput, token_str: TokenStr
) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` for the choice, when the request asked for them: the
    prompt token itself (with its rank) then the `req.prompt_logprobs` most likely ones."""
    if req.prompt_logprobs is None or out.prompt_logprobs is None:
        return None
    body: list[dict[str, PromptLogprob] | None] = []
    for lp in out.prompt_logprobs:
        if lp is None:
            body.append(None)
            continue
        entry = {
            str(lp.token_id): PromptLogprob(
                logprob=json_logprob(lp.logprob), rank=lp.rank, decoded_token=token_str(lp.token_id)
            )
        }
        for rank, (tid, value) in enumerate(lp.top[: req.prompt_logprobs], start=1):
            entry.setdefault(
                str(tid),
                PromptLogprob(logprob=json_logprob(value), rank=rank, decoded_token=token_str(tid)),
            )
        body.append(entry)
    return body
