"""Freeze every process of an agent while its verifier runs: see :mod:`.freeze`.

Kept so that ``from .freezer import Freezer, make_freezer`` goes on working.
"""

from .freeze import CgroupFreezer, FreezeError, FreezeOutcome, Freezer, SignalFreezer, make_freezer

__all__ = ["Freezer", "FreezeOutcome", "FreezeError", "CgroupFreezer", "SignalFreezer", "make_freezer"]
