"""Moving chunks between the pool and the tiers, on the server.

``write_behind`` copies committed chunks from the pool to the tiers, ``prefetch`` loads the
chunks that follow a lookup's hit prefix back into the pool, ``lookups`` counts every
lookup's hits by tier and its misses by reason, and ``data_movement`` (:class:`Tiering`) puts
the three together over the tiers the wiring built; ``tier_quotas`` holds the tenant quotas
of a tier below the pool (the disk) and tells the write-behind what to write and evict. The
media themselves live in :mod:`tierkv.tiers`; the cluster's peer tier in :mod:`tierkv.cluster`.
"""

from tierkv.server.tiering.data_movement import Tiering
from tierkv.server.tiering.lookups import LookupAccounting
from tierkv.server.tiering.tier_quotas import NamespacedTier, TierQuota

__all__ = ["LookupAccounting", "NamespacedTier", "TierQuota", "Tiering"]
