"""Fair share by tenant: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024), counted in weighted tokens.

Each tenant has a counter of the service it has received: every token the scheduler hands
one of its requests adds that token's charge (`charges.ChargeRules`) divided by the
tenant's weight. Admission takes the next request from the backlogged tenant (one with a
request waiting) whose counter is lowest, so backlogged tenants' counters stay within a
bounded distance of each other: over any interval in which two tenants are both backlogged,
the weighted service each got differs by at most about twice the largest single charge (one
request's prompt, or one step's decodes of a full batch), however long the interval. That
is the fairness bound the scheduler tests check.

Idling earns no credit: a tenant that becomes backlogged again is lifted to the lowest
counter among the tenants backlogged at that moment (or, if none is, to the counter of the
tenant that last stopped being backlogged), so it shares from then on instead of
monopolising the engine to make up for time it did not ask for anything. The scheduler is
work-conserving whatever the counters say: a lone tenant gets the whole engine.

The hooks other features call (each says when): `charge_scheduled` (the scheduler, for
every chunk it hands out), `charge_cache_hits` (prefix-cache hits at admission; a KV tier's
loads with `tier=True`), `charge_rejected` (speculative tokens the verifier rejected).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.core.policy.charges import ChargeRules
from engine.core.request import Request


class VirtualTokenCounter:
    """Per-tenant weighted service, by tenant name."""

    def __init__(self, rules: ChargeRules):
        self.rules = rules
        self._counters: dict[str, float] = {}
        self._last_left = 0.0  # the counter of the tenant that last stopped being backlogged

    def value(self, name: str) -> float:
        return self._counters.get(name, 0.0)

    def snapshot(self) -> dict[str, float]:
        return dict(self._counters)

    # ---- backlog changes (the waiting queue calls these) -----------------------------------
    def lift(self, name: str, backlogged: Iterable[str]) -> None:
        """Tenant `name` has just become backlogged: raises its counter to the lowest among
        the other backlogged tenants (or to the last one to leave when there is none)."""
        counters = self._counters
        floor = min((counters.get(t, 0.0) for t in backlogged if t != name), default=None)
        if floor is None:
            floor = self._last_left
        if counters.get(name, 0.0) < floor:
            counters[name] = floor

    def left(self, name: str) -> None:
        """Tenant `name` has no request waiting any more."""
        self._last_left = self._counters.get(name, 0.0)

    # ---- charges -----------------------------------------------------------------------------
    def _add(self, req: Request, cost: float) -> None:
        if cost:
            name = req.tenant.name
            self._counters[name] = self._counters.get(name, 0.0) + cost / req.tenant.weight

    def charge_scheduled(
        self, req: Request, start: int, n: int, *, embedding: bool = False
    ) -> None:
        """The scheduler hands `req` positions [start, start + n) this step.

        Positions below `req.num_charged_tokens` were charged before (computed, then lost
        to a preemption): they are recompute. `embedding`: `req` is prefill-only (the
        embeddings work passes its request's flag here).
        """
        end = start + n
        mark = req.num_charged_tokens
        p = req.num_prompt_tokens
        fresh = start if start >= mark else min(mark, end)  # fresh positions: [fresh, end)
        re_in = re_out = 0
        if fresh > start:
            re_in = max(0, min(fresh, p) - start)
            re_out = fresh - start - re_in
        inp = max(0, min(end, p) - fresh)
        out = end - fresh - inp
        if end > mark:
            req.num_charged_tokens = end
        rules = self.rules
        if not (re_in or re_out or embedding):  # the hot path: a decode or a fresh chunk
            cost = inp * rules.input_token + out * rules.output_token
        else:
            cost = rules.cost(
                inp, out, recomputed_input=re_in, recomputed_output=re_out, embedding=embedding
            )
        self._add(req, cost)

    def charge_running(self, running: list[Request], num_scheduled: dict[str, int]) -> None:
        """`charge_scheduled` for every request of the step's running batch (each from its
        `num_computed_tokens`), inlined for the decode hot path: a request past its prompt
        with nothing to recompute costs `charge_output_token` per token, anything else
        takes the general rule."""
        w_out = self.rules.output_token
        counters = self._counters
        for r in running:
            n = num_scheduled[r.request_id]
            start = r.num_computed_tokens
            if start >= r.num_charged_tokens and start >= len(r.prompt_token_ids):
                r.num_charged_tokens = start + n
                t = r.tenant
                counters[t.name] = counters.get(t.name, 0.0) + n * w_out / t.weight
            else:
                self.charge_scheduled(r, start, n)

    def charge_cache_hits(self, req: Request, upto: int, *, tier: bool = False) -> None:
        """Prompt positions [req.num_charged_tokens, upto) were served from the prefix cache
        (a forked sample's shared prompt included) or, with `tier`, loaded from a KV tier,
        instead of computed. Charged only as `charge_prefix_cache_hits` /
        `charge_tier_cache_hits` say; later recompute of them counts as recompute."""
        hits = upto - req.num_charged_tokens
        if hits <= 0:
            return
        req.num_charged_tokens = upto
        if tier:
            self._add(req, self.rules.cost(tier_hit_tokens=hits))
        else:
            self._add(req, self.rules.cost(prefix_hit_tokens=hits))

    def charge_rejected(self, req: Request, n: int) -> None:
        """`n` speculative positions charged when scheduled were rejected by the verifier
        (the speculative decoding work calls this after it rolls `num_computed_tokens`
        back): refunded unless `charge_rejected_speculative`, and fresh again when
        scheduled next."""
        if n <= 0:
            return
        req.num_charged_tokens = max(0, req.num_charged_tokens - n)
        self._add(req, self.rules.cost(rejected_tokens=n))
