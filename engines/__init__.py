"""Engines: one interface, several implementations (simulated, vLLM in Ray, remote vLLM)."""

from wasma.engines.base import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineClient,
    EngineStats,
    GenerateRequest,
    KVEvent,
    TokenChunk,
)
from wasma.engines.sim.core import SimEngineCore, SimRequest
from wasma.engines.sim.profile import Profile, ProfileError, load_profile

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
