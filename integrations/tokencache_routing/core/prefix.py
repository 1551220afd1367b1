"""What one forward's rows read of their shared slot-list prefixes (PrefixRead): set on a
PreparedForward by the engine when its GPU clock (sim/clock.py) models the shared-prefix path,
and priced there. Here, in core, so that the batch and state modules need nothing from sim/."""

from __future__ import annotations

from dataclasses import dataclass

from tokencache_models import PrefixGroup


@dataclass(frozen=True)
class PrefixRead:
    """How one forward's rows read their shared slot-list prefixes on the modelled runner: the
    groups that take the shared-prefix path (tokencache_models.paying_groups; empty: every row
    reads its own slot list), and their traffic in KV slots per layer
    (tokencache_models.prefix_traffic): `skipped`, what the groups' rows no longer read
    themselves (rows x P summed over the groups), and `read`, what the prefix path reads
    instead (each P once per tile of its group's query tokens, plus the split partials).
    Depends on the model's PrefixShape: price it with the kind it was found for."""

    groups: tuple[PrefixGroup, ...] = ()
    skipped: int = 0
    read: int = 0

    @property
    def saved(self) -> int:
        """KV slots per layer the forward reads less than its rows' whole slot lists (> 0
        whenever a group is kept: paying_groups keeps none otherwise)."""
        return self.skipped - self.read

    @property
    def longest(self) -> int:
        """The longest prefix read once (0: none)."""
        return max((g.length for g in self.groups), default=0)

    @property
    def rows(self) -> int:
        """Rows that skip a prefix."""
        return sum(len(g.rows) for g in self.groups)


# Every row reads its own slot list: no shared-prefix path, or nothing worth it.
NO_PREFIX = PrefixRead()
