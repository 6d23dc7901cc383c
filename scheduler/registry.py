"""The one place policy names map to policy classes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from wasma.core.profile import Profile
from wasma.scheduler.policies.baselines import (
    KVAware,
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    Session,
)
from wasma.scheduler.policies.ray_serve import RayPow2, RayPrefixAffinity
from wasma.scheduler.policies.wasma import Wasma
from wasma.scheduler.policy import Policy, PolicyContext

PolicyFactory = Callable[[PolicyContext], Policy]


class UnknownPolicy(ValueError):
    pass


class PolicyRegistry:
    def __init__(self) -> None:
        self._factories: dict[str, PolicyFactory] = {}

    def register(self, name: str, factory: PolicyFactory) -> None:
        if name in self._factories:
            raise ValueError(f"policy {name!r} registered twice")
        self._factories[name] = factory

    def names(self) -> list[str]:
        return list(self._factories)

    def create(self, name: str, ctx: PolicyContext) -> Policy:
        factory = self._factories.get(name)
        if factory is None:
            raise UnknownPolicy(
                f"unknown policy {name!r}; choose from: {', '.join(self._factories)}"
            )
        return factory(ctx)

    def check(self, name: str, params: Mapping[str, Any], profile: Profile) -> None:
        """Build policy `name` once with `params` on a one-engine cluster, so a bad name
        or parameter fails (ValueError, naming it) before any run or server starts."""
        from wasma.scheduler.prefix_index import PrefixIndex
        from wasma.scheduler.state import ClusterState
        from wasma.scheduler.workflows import WorkflowRegistry

        ctx = PolicyContext(
            ClusterState(["e0"]), PrefixIndex(["e0"]), WorkflowRegistry(), profile, params=params
        )
        self.create(name, ctx)


def default_registry() -> PolicyRegistry:
    reg = PolicyRegistry()
    for cls in (
        RoundRobin,
        LeastLoaded,
        PrefixAware,
        KVAware,
        Session,
        RayPow2,
        RayPrefixAffinity,
        Wasma,
    ):
        reg.register(cls.name, cls)
    return reg
