"""Tiers below the shared-memory pool (L2 and beyond): one interface, one module per tier.

Each tier module registers its tier (:func:`register_tier`) when it is imported; the
built-in ones (disk, redis, s3) are imported the first time a tier is named
(:func:`tier_names`, :func:`tier_options`, :func:`create_tier`), so a tier whose client
library is missing stays unregistered. :func:`create_tier` builds one by name.
"""

from tierkv.tiers.base import LoadStatus, Tier, TierError, TierUsage
from tierkv.tiers.registry import create_tier, register_tier, tier_names

__all__ = [
    "LoadStatus",
    "Tier",
    "TierError",
    "TierUsage",
    "create_tier",
    "register_tier",
    "tier_names",
]
