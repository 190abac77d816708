"""Fleets: one cartridge per document, trained jointly under a memory budget, picked per query.

Reader API: `Fleet.open(directory, lm)`, then `fleet.select(query, k)` (document names,
best first) and `fleet.rows(names)` (their cartridges composed in that order).
"""

from cartridges.fleet.api import Fleet

__all__ = ["Fleet"]
