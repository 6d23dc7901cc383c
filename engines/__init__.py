"""Engines: one interface, several implementations (simulated, vLLM in Ray, remote vLLM)."""

from wasma.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EngineStats, KVEvent
from wasma.core.profile import Profile, ProfileError, load_profile
from wasma.engines.base import EngineClient, GenerateRequest, TokenChunk
from wasma.engines.sim.core import SimEngineCore, SimRequest

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineClient",
    "EngineStats",
    "GenerateRequest",
    "KVEvent",
    "Profile",
    "ProfileError",
    "SimEngineCore",
    "SimRequest",
    "TokenChunk",
    "load_profile",
]
