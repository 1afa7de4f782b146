"""KV tiers behind the pool, torch-free: the core's index of each tier and every decision.

- `index`: `TierIndex`, one tier's entries by block hash in LRU order, by bytes (and slots).
- `manager`: `KVTierManager`, save on free, loads and the loading state, evictions,
  the moves named in `SchedulerOutput` and the reports read from `RunnerOutput`.

The worker's side (copies, files, threads) is `engine.worker.kv_tier`.
"""

from engine.core.kv_tier.index import TierIndex
from engine.core.kv_tier.manager import KVTierManager, KVTierStats, TierSizes

__all__ = ["KVTierManager", "KVTierStats", "TierIndex", "TierSizes"]
