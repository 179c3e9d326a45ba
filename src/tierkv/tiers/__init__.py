"""Tiers below the shared-memory pool (L2 and beyond): one interface, one module per tier.

Importing this package registers the built-in tiers; :func:`create_tier` builds one by name.
"""

from tierkv.tiers.base import (
    LoadStatus,
    Tier,
    TierError,
    TierUsage,
    create_tier,
    register_tier,
    tier_names,
)

__all__ = [
    "LoadStatus",
    "Tier",
    "TierError",
    "TierUsage",
    "create_tier",
    "register_tier",
    "tier_names",
]
