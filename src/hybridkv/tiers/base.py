"""The contract every secondary tier keeps, and the registry that opens tiers by name.

A secondary tier holds self-checking pages (``tiers.pagefile``) under the layout's
fingerprint. It never raises into the engine once open: an I/O error, an outage or a corrupt
page is a miss (``False``) plus a counter in ``stats``. A new tier (S3, another store) is one
module that subclasses ``SecondaryTier`` and calls ``register_tier``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np

from hybridkv.core.layout import Layout

ReadItem = tuple[int, bytes, np.ndarray]     # (group, key, destination page)
WriteItem = tuple[int, bytes, object]        # (group, key, buffer of one page)


class SecondaryTier(ABC):
    """Pages below RAM: a local directory, a Redis/Valkey server, ..."""

    name: str
    stats: dict[str, int]

    @abstractmethod
    def contains_many(self, group: int, keys: Sequence[bytes]) -> list[bool]:
        """Is each key stored? Batched: one round trip or index lookup for all of them."""

    @abstractmethod
    def submit_reads(self, items: Sequence[ReadItem]) -> list[Future]:
        """Read pages into the given buffers in the background; each future gives a bool."""

    @abstractmethod
    def submit_writes(self, items: Sequence[WriteItem]) -> list[Future]:
        """Write pages in the background; the buffers stay valid until the futures finish."""

    def flush(self) -> None:  # noqa: B027 - optional: most tiers hold nothing back
        """A natural end of a batch (a request finished): write what is being held back."""

    def wait_ready(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` s, until lookups can see what the tier held at open (a
        store's start-up scan indexes it in the background). Engines call it once at start-up:
        lookups themselves never wait, they answer from what is known."""
        return True

    @abstractmethod
    def close(self) -> None:
        """Finish queued work and release files, threads and connections."""


# name -> (config setting that enables it, factory(setting value, layout, config))
TierFactory = Callable[[object, Layout, object], SecondaryTier]
_REGISTRY: dict[str, tuple[str, TierFactory]] = {}


def register_tier(name: str, setting: str, factory: TierFactory) -> None:
    """Make ``name`` openable; it is opened when config ``setting`` is set (e.g. ``store``)."""
    _REGISTRY[name] = (setting, factory)


def _load_builtin_tiers() -> None:
    # Importing the modules registers them; the remote tier imports redis only when opened.
    from hybridkv.tiers import filesystem, remote  # noqa: F401


def open_tiers(layout: Layout, config) -> list[SecondaryTier]:
    """Open every registered tier whose setting is present in ``config``, in registry order
    (local before remote, so promotions read the nearest copy)."""
    _load_builtin_tiers()
    tiers: list[SecondaryTier] = []
    try:
        for setting, factory in _REGISTRY.values():
            value = getattr(config, setting, None)
            if value:
                tiers.append(factory(value, layout, config))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers
