"""Engines: one interface, several implementations (simulated, vLLM in Ray, remote vLLM)."""

from engines.base import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineClient,
    EngineStats,
    GenerateRequest,
    KVEvent,
    TokenChunk,
)
from engines.sim.core import SimEngineCore, SimRequest
from engines.sim.profile import Profile, ProfileError, load_profile

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
