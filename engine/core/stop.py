"""Stop conditions checked by the scheduler after each sampled token (stop strings are the
detokenizer's: the engine reports them through `Scheduler.finish_requests`)."""

from __future__ import annotations

from engine.core.request import Request, RequestStatus


def check_stop(request: Request, token: int, max_model_len: int) -> bool:
    """Sets a finished status and returns True if `token`, just appended, ends the request.

    In order: any of the request's EOS ids (unless `ignore_eos`) and `stop_token_ids`, both only once `min_tokens`
    outputs exist, then the length caps (`max_tokens`, `max_model_len`). EOS leaves
    `stop_reason` None; a stop token id becomes the `stop_reason`.
    """
    sp = request.sampling_params
    num_out = len(request.output_token_ids)
    if num_out >= sp.min_tokens:
        if token in request.eos_token_ids and not sp.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None
            return True
        if sp.stop_token_ids and token in sp.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
            return True
    if num_out >= request.max_tokens or len(request.all_token_ids) >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False
