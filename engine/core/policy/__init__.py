"""Scheduling policy: who goes next when more is asked of the engine than it can serve.

Torch-free, like the rest of `engine.core`. The scheduler asks this package four things and
nothing else: which waiting request to admit next (`tenant_queue`: per-tenant queues, the
tenant picked by the policy's rule), which running request to preempt (`victims`), what a
step's tokens cost each tenant (`charges`, `fair_share`: the Virtual Token Counter), and
which requests may not be queued or must leave (`deadlines`, `token_rate`, the per-tenant
limits). `policy.SchedulingPolicy` bundles them for one scheduler.

Tenants are a request field (`Request.tenant`, a `Tenant`): the appliance maps API keys to
tenants; nothing here knows about keys.
"""
