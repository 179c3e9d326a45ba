"""Tiers by name: each tier module registers its factory (:func:`register_tier`) when it
is imported; the built-in ones (disk, redis, s3) are imported the first time a tier is
named, so a tier whose client library is missing stays unregistered. Options from the
command line, the environment or YAML are checked and typed against the factory's
signature before anything is opened (:func:`tier_options`); :func:`create_tier` builds one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from tierkv.options import OptionError, as_kwargs, convert, signature_struct
from tierkv.tiers.base import Tier, TierError

log = logging.getLogger(__name__)

TierFactory = Callable[..., Tier]
_REGISTRY: dict[str, TierFactory] = {}


def register_tier(name: str, factory: TierFactory) -> None:
    """Make a tier available to configuration under ``name``."""
    _REGISTRY[name] = factory
    _OPTION_STRUCTS.pop(name, None)


def tier_names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def tier_factories() -> dict[str, TierFactory]:
    """Every available tier's factory by name (an alias names the same factory)."""
    _load_builtins()
    return dict(_REGISTRY)


def tier_options(name: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The options of tier ``name``, checked and typed, without opening anything.

    The tier's constructor signature declares its options, their types and defaults.
    Options from the command line or the environment (``--tier disk:path=...,fsync=false``)
    arrive as strings and become those types (``fsync=false`` is False, ``capacity=100GiB``
    a byte count); typed values (YAML) are checked. An unknown tier, an unknown or missing
    option, a value of the wrong type and what the tier's :meth:`Tier.check_options`
    refuses (a malformed URL) raise :class:`TierError`."""
    _load_builtins()
    factory = _REGISTRY.get(name)
    if factory is None:
        raise TierError(f"unknown tier {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    struct = _OPTION_STRUCTS.get(name)
    if struct is None:
        struct = _OPTION_STRUCTS[name] = signature_struct(factory, f"{name}_options")
    try:
        typed = as_kwargs(convert(dict(options or {}), struct, what=f"tier {name!r}"))
    except OptionError as exc:
        raise TierError(str(exc)) from None
    check = getattr(factory, "check_options", None)
    if check is not None:
        check(**typed)
    return typed


def create_tier(name: str, options: Mapping[str, Any] | None = None) -> Tier:
    """Build (connect, open) the tier ``name`` with its options (see :func:`tier_options`)."""
    return _REGISTRY[name](**tier_options(name, options))


_OPTION_STRUCTS: dict[str, type[Any]] = {}


def _load_builtins() -> None:
    import importlib

    for module in ("disk", "redis", "s3"):
        try:
            importlib.import_module(f"tierkv.tiers.{module}")
        except ImportError as exc:
            # An optional tier whose client library is missing stays unregistered.
            log.debug("tier module %s unavailable: %s", module, exc)
