"""Structured outputs under speculation: a mask for every verified position, forced tokens.

Position j of a request verifying proposals d0..dk-1 must be masked by the grammar as it
stands after d0..dj-1. For an active matcher llguidance computes all of them in one call
(`fill_bitmask(..., drafts=...)`: it advances the matcher over the proposals it accepts and
rolls it back). A request still waiting for its grammar's `start_after` marker is played
forward on a shallow copy of its `GrammarState` (the copy's matcher, made when a proposal
completes the marker, is dropped afterwards), so its real state moves only with the tokens
the verification accepts, as without speculation.

`forced_tokens`: the tokens the grammar allows alone from the current state (llguidance's
fast-forward), proposed for free: verification accepts them unless a mask of the request's
own (min_tokens, allowed ids) says otherwise.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np

from engine.worker.structured.bitmask import fill_bitmask
from engine.worker.structured.matcher import GrammarState


def verify_bitmask(
    executor,
    groups: Sequence[tuple[int, GrammarState | None, Sequence[int]]],
    num_rows: int,
    vocab_size: int,
    eos_token_ids: Sequence[int],
) -> tuple[np.ndarray | None, list[bool]]:
    """For (first row, grammar state or None, proposals) per request: the [num_rows, W]
    bitmask (None when no row is constrained) and, per row, whether the grammar masks it."""
    constrained = [False] * num_rows
    matchers, drafts = [], []
    llg_eos = None
    for first, state, proposals in groups:
        if state is None:
            continue
        if not state.active:
            state, first, proposals = _play_to_marker(state, first, proposals)
            if state is None:
                continue
        matchers.append((first, state.matcher))
        drafts.append(list(proposals))
        for j in range(len(proposals) + 1):
            constrained[first + j] = True
        llg_eos = state.grammar.eos_token_id
    if not matchers:
        return None, constrained
    mask = fill_bitmask(
        executor, matchers, num_rows, vocab_size, llg_eos, eos_token_ids, drafts=drafts
    )
    return mask, constrained


def _play_to_marker(
    state: GrammarState, first: int, proposals: Sequence[int]
) -> tuple[GrammarState | None, int, Sequence[int]]:
    """A waiting state played over the proposals on a copy: the first position where the
    grammar would be active, as (copy, its row, the proposals from there), or None."""
    probe = copy.copy(state)
    for j, tok in enumerate(proposals):
        probe.advance(tok)
        if probe.active:
            return probe, first + j + 1, proposals[j + 1 :]
    return None, first, ()


def forced_tokens(state: GrammarState | None, limit: int) -> list[int]:
    """Up to `limit` tokens the grammar forces next (none while it is waiting or errored)."""
    if state is None or not state.active or state.matcher.is_error():
        return []
    return list(state.matcher.compute_ff_tokens()[:limit])
