"""The ``multiprocessing`` shared-memory segments and semaphores vLLM's processes leave behind.

vLLM's executor and its workers pass messages through queues in Python shared-memory
segments (``/dev/shm/psm_*``), and multiprocessing's locks are named semaphores
(``/dev/shm/sem.mp-*``). A process that is killed, or whose parent goes first, never
unlinks its own, and on a machine that keeps ``/dev/shm`` (a developer's, a CI runner's)
each run leaves hundreds of MiB (and a semaphore) there. A harness takes
:func:`python_segments` before it starts vLLM and calls :func:`remove_orphans` with it once
every vLLM process is gone: what appeared meanwhile and no live process maps is removed, so
nothing of another process is touched (the tierkv pool is never a ``psm_`` segment anyway).
"""

from __future__ import annotations

from pathlib import Path

SHM = Path("/dev/shm")


def python_segments() -> set[Path]:
    """Every Python shared-memory segment and multiprocessing semaphore now."""
    return set(SHM.glob("psm_*")) | set(SHM.glob("sem.mp-*"))


def mapped_segments() -> set[Path]:
    """The ``/dev/shm`` files that some live process maps."""
    mapped: set[Path] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
                mapped.add(Path(fields[5].removesuffix(" (deleted)")))
    return mapped


def remove_orphans(before: set[Path]) -> list[Path]:
    """Remove the Python segments that are not in ``before`` and that no live process maps;
    returns them."""
    new = python_segments() - before
    if not new:
        return []
    orphans = sorted(new - mapped_segments())
    for segment in orphans:
        segment.unlink(missing_ok=True)
    return orphans
