"""Where a hybrid model's prefix can be restored: HiCache's per-pool hit policies.

``batch_exists_v2`` answers, for a run of KV page keys, at which prefix lengths (in pages)
every pool can restore the state the engine needs there. SGLang gives each extra pool a
hit policy:

- ``all_pages``: every page of the prefix must be present in the pool (DSA indexer pages);
  the pool restores the prefixes up to its first missing page.
- ``trailing_pages``: only the last ``N`` pages of the prefix must be present, ``N`` being
  the number of keys SGLang passes for the pool (1 for a Mamba state, which holds the whole
  prefix in the state stored under its last page's key; the window's pages for sliding-
  window attention). Such a pool leaves holes: prefix 5 may be restorable and 4 not.

Any other policy (``block_groups``, or one a later SGLang adds) is one this module does not
know, and a pool it cannot judge restores no prefix: a miss, never a wrong state.

:func:`restorable_prefixes` computes a pool's set from a presence probe; the probe is asked
about runs of pages only where the answer is not known yet (each answer says which leading
pages of a run are present and, if short, which page is missing), so a pool costs a few
lookups, not one per page.
"""

from __future__ import annotations

from collections.abc import Callable

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
POLICIES = frozenset({ALL_PAGES, TRAILING_PAGES})

# probe(start, stop): how many leading pages of pages[start:stop] the pool holds.
Probe = Callable[[int, int], int]


def window_pages(policy: str, keys: list[str] | None) -> int:
    """Pages a trailing-pages pool needs at the end of a prefix (at least one)."""
    return max(1, len(keys or ())) if policy == TRAILING_PAGES else 0


class Presence:
    """What is known of one pool's pages ``[0, pages)``. An unknown page is probed with
    the run from it to the end: one answer marks that run's leading present pages and the
    missing page after them, so learning every page costs one probe per missing page."""

    def __init__(self, pages: int, probe: Probe) -> None:
        self._probe = probe
        self._known: dict[int, bool] = {}
        self.pages = pages
        self.probes = 0

    def present(self, page: int) -> bool:
        if page not in self._known:
            self.probes += 1
            held = max(0, min(self._probe(page, self.pages), self.pages - page))
            for i in range(page, page + held):
                self._known[i] = True
            if page + held < self.pages:
                self._known[page + held] = False
        return self._known[page]

    def all_present(self, start: int, stop: int) -> bool:
        """Whether the pool holds every page of ``[start, stop)``."""
        return all(self.present(page) for page in range(start, stop))


def restorable_prefixes(policy: str, window: int, kv_pages: int, probe: Probe) -> list[int]:
    """The prefix lengths ``1..kv_pages`` (ascending) at which a pool with ``policy`` can
    restore its state; ``[]`` for a policy this module does not know."""
    if policy not in POLICIES or kv_pages <= 0:
        return []
    presence = Presence(kv_pages, probe)
    if policy == ALL_PAGES:
        boundary = 0
        while boundary < kv_pages and presence.present(boundary):
            boundary += 1
        return list(range(1, boundary + 1))
    return [
        end for end in range(1, kv_pages + 1) if presence.all_present(max(0, end - window), end)
    ]
