"""What a tenant is charged for the engine's work: the one rule every charge goes through.

The fair policies (`fair`, `deadline`) keep one counter per tenant (`fair_share`) and charge
it, in weighted tokens, for the work the engine does for that tenant's requests. Which work
counts is configuration (`scheduler.charge_*`, defaults below); `ChargeRules.cost` is the
only place that turns token counts into a charge (the counter's hot path inlines its plain
case, fresh tokens times their weight; tests/core/test_charges.py pins the two equal), so a
feature that changes what a step computes (speculative decoding, a KV tier, embeddings)
calls the counter's hooks and never writes its own arithmetic.

What is counted, per request:
- input tokens: prompt positions whose K/V the engine computes (`charge_input_token` each);
- output tokens: positions at or past the prompt's end, i.e. generated tokens fed back
  through the model (`charge_output_token` each). A request's last sampled token is never
  fed back, so it costs nothing: the counter charges computed positions, not text;
- prompt tokens read from the prefix cache instead of computed: charged as input only with
  `charge_prefix_cache_hits` (default false: the engine did not compute them). A forked
  sample's shared prompt (`n > 1`) counts as such a hit;
- prompt tokens loaded from a KV tier (host or disk) instead of computed: charged as input
  only with `charge_tier_cache_hits` (default false);
- tokens recomputed after a preemption (positions charged once already): charged only with
  `charge_recompute` (default false: a preemption is the scheduler's choice, not the
  victim's fault);
- speculative tokens the verifier rejected: kept in the charge only with
  `charge_rejected_speculative` (default false: the tenant is charged for the tokens it
  got);
- embedding (prefill-only) requests: charged like any prompt, or not at all with
  `charge_embeddings: false`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import SchedulerConfig


@dataclass(frozen=True, slots=True)
class ChargeRules:
    """The `scheduler.charge_*` settings; `cost` applies them."""

    input_token: float = 1.0
    output_token: float = 2.0
    prefix_cache_hits: bool = False
    tier_cache_hits: bool = False
    rejected_speculative: bool = False
    recompute: bool = False
    embeddings: bool = True

    @classmethod
    def of(cls, config: SchedulerConfig) -> ChargeRules:
        return cls(
            input_token=config.charge_input_token,
            output_token=config.charge_output_token,
            prefix_cache_hits=config.charge_prefix_cache_hits,
            tier_cache_hits=config.charge_tier_cache_hits,
            rejected_speculative=config.charge_rejected_speculative,
            recompute=config.charge_recompute,
            embeddings=config.charge_embeddings,
        )

    def cost(
        self,
        input_tokens: int = 0,
        output_tokens: int = 0,
        *,
        recomputed_input: int = 0,
        recomputed_output: int = 0,
        prefix_hit_tokens: int = 0,
        tier_hit_tokens: int = 0,
        rejected_tokens: int = 0,
        embedding: bool = False,
    ) -> float:
        """Weighted tokens to charge a tenant (before its weight divides it).

        `input_tokens` / `output_tokens`: positions computed for the first time, before /
        at or past the prompt's end; `recomputed_*`: positions computed again after a
        preemption; `prefix_hit_tokens` / `tier_hit_tokens`: prompt positions served from
        the prefix cache / a KV tier; `rejected_tokens`: speculative positions charged when
        scheduled and rejected by the verifier (a negative charge, a refund, unless
        `rejected_speculative`); `embedding`: the request is prefill-only (pooling).
        """
        if embedding and not self.embeddings:
            return 0.0
        inp = input_tokens
        out = output_tokens
        if self.recompute:
            inp += recomputed_input
            out += recomputed_output
        if self.prefix_cache_hits:
            inp += prefix_hit_tokens
        if self.tier_cache_hits:
            inp += tier_hit_tokens
        if not self.rejected_speculative:
            out -= rejected_tokens
        return inp * self.input_token + out * self.output_token
