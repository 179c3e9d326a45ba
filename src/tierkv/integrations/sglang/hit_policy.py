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

:func:`longest_restorable` finds the longest prefix every pool can restore, checking
prefix lengths from the longest down; a presence probe is a lookup of a run of pages (how
many of its leading pages the pool holds), and each check probes only the pages of its
window not known yet, at most ``MAX_PROBES`` per pool and query (past that: no hit).

It answers that one length, not every restorable length as SGLang's file backend does:
a second lookup per shorter length would cost a probe each (a Mamba state exists only at
the few pages where SGLang stored one), on every prefetch. With several ranks SGLang
intersects the ranks' answers; ranks back up the same prefixes, so they agree, and where
one rank lacks the state (its write failed) the intersection is empty: a miss, never a
state that rank cannot restore.
"""

from __future__ import annotations

from collections.abc import Callable

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
POLICIES = frozenset({ALL_PAGES, TRAILING_PAGES})

MAX_PROBES = 32  # presence probes per pool and query (each a lookup)

# probe(start, stop): how many leading pages of pages[start:stop] the pool holds.
Probe = Callable[[int, int], int]


def window_pages(policy: str, keys: list[str] | None) -> int:
    """Pages a trailing-pages pool needs at the end of a prefix (at least one)."""
    return max(1, len(keys or ())) if policy == TRAILING_PAGES else 0


class BudgetSpent(Exception):
    """The pool's probes for this query are spent."""


class Presence:
    """What is known of one pool's pages, filled by probing runs of unknown pages."""

    def __init__(self, probe: Probe, budget: int = MAX_PROBES) -> None:
        self._probe = probe
        self._known: dict[int, bool] = {}
        self.budget = budget
        self.probes = 0

    def all_present(self, start: int, stop: int) -> bool:
        """Whether the pool holds every page of ``[start, stop)``; :class:`BudgetSpent`
        when that needs a probe past the budget."""
        page = start
        while page < stop:
            if page in self._known:
                if not self._known[page]:
                    return False
                page += 1
                continue
            end = page + 1  # the run of unknown pages from here
            while end < stop and end not in self._known:
                end += 1
            if self.probes >= self.budget:
                raise BudgetSpent
            self.probes += 1
            held = max(0, min(self._probe(page, end), end - page))
            for i in range(page, page + held):
                self._known[i] = True
            if page + held < end:
                self._known[page + held] = False
                return False
            page = end
        return True


class PoolCheck:
    """Whether one pool restores its state at a prefix length (in pages)."""

    def __init__(self, policy: str, window: int, probe: Probe, budget: int = MAX_PROBES) -> None:
        if policy not in POLICIES:
            raise ValueError(f"hit policy {policy!r} is not supported")
        self.policy = policy
        self.window = window
        self.presence = Presence(probe, budget)
        self.longest = 0  # the longest prefix this pool was seen to restore

    def restores(self, end: int) -> bool:
        """:class:`BudgetSpent` when answering needs a probe past the budget."""
        start = 0 if self.policy == ALL_PAGES else max(0, end - self.window)
        ok = self.presence.all_present(start, end)
        if ok:
            self.longest = max(self.longest, end)
        return ok


def longest_restorable(checks: list[PoolCheck], kv_pages: int) -> int:
    """The longest prefix ``<= kv_pages`` every pool of ``checks`` restores (0: none, or
    not found within the probe budget)."""
    try:
        for end in range(kv_pages, 0, -1):
            if all(check.restores(end) for check in checks):
                return end
    except BudgetSpent:
        pass
    return 0
