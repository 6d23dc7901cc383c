"""How the gateway reaches the router: in-process, or an async Ray actor.

Both clients answer the same calls, so the gateway never knows where the router runs.
Across Ray, requests are multiplexed over one channel per gateway (deploy/ray_channel.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from wasma.deploy.ray_channel import ChannelClient
from wasma.deploy.router_service import RouterService
from wasma.deploy.service_types import ServiceError, ServiceRequest, ServiceResult, Unavailable
from wasma.engines.base import TokenChunk


class TokenStream(Protocol):
    engine: str
    kind: str

    def __aiter__(self) -> AsyncIterator[TokenChunk]: ...

    async def aclose(self) -> None: ...


class RouterClient(Protocol):
    async def open(self, req: ServiceRequest) -> TokenStream: ...

    async def complete(self, req: ServiceRequest) -> ServiceResult: ...

    async def register_workflow(self, data: Mapping[str, Any], tenant: str) -> dict[str, Any]: ...

    async def workflow_status(self, workflow_id: str, tenant: str) -> dict[str, Any]: ...

    async def health(self) -> dict[str, Any]: ...

    async def render_metrics(self, http_codes: Mapping[Any, int]) -> tuple[bytes, str]: ...

    async def close(self) -> None: ...


class LocalRouterClient:
    """The router service in this process (tests, `--router-in-process`, benchmarks)."""

    def __init__(self, service: RouterService, owns: bool = True) -> None:
        self.service = service
        self._owns = owns

    async def open(self, req: ServiceRequest) -> TokenStream:
        return await self.service.open(req)

    async def complete(self, req: ServiceRequest) -> ServiceResult:
        return await self.service.complete(req)

    async def register_workflow(self, data: Mapping[str, Any], tenant: str) -> dict[str, Any]:
        return self.service.register_workflow(data, tenant)

    async def workflow_status(self, workflow_id: str, tenant: str) -> dict[str, Any]:
        return self.service.workflow_status(workflow_id, tenant)

    async def health(self) -> dict[str, Any]:
        return self.service.health()

    async def render_metrics(self, http_codes: Mapping[Any, int]) -> tuple[bytes, str]:
        return self.service.render_metrics(http_codes)

    async def close(self) -> None:
        if self._owns:
            await self.service.close()


class RayRouterClient:
    """The router service inside an async Ray actor (`RouterActor`). A client that
    does not own the actor (a gateway that joined a shared router) leaves it running
    when it closes: other gateways still route through it."""

    def __init__(self, handle: Any, owns: bool = True, direct: bool = False) -> None:
        self.handle = handle
        self._owns = owns
        self._channel = ChannelClient(handle, direct=direct)

    async def open(self, req: ServiceRequest) -> TokenStream:
        return await self._channel.open(req)

    async def complete(self, req: ServiceRequest) -> ServiceResult:
        return await self._channel.complete(req)

    async def _call(self, method: str, *args: Any) -> Any:
        """One actor call; a router that is dead or restarting is a retryable 503."""
        from ray.exceptions import RayActorError

        try:
            return await getattr(self.handle, method).remote(*args)
        except ServiceError:
            raise
        except RayActorError as exc:
            raise Unavailable(
                f"the router is restarting; retry shortly ({exc})", None, 1.0
            ) from None

    async def register_workflow(self, data: Mapping[str, Any], tenant: str) -> dict[str, Any]:
        out: dict[str, Any] = await self._call("register_workflow", dict(data), tenant)
        return out

    async def workflow_status(self, workflow_id: str, tenant: str) -> dict[str, Any]:
        out: dict[str, Any] = await self._call("workflow_status", workflow_id, tenant)
        return out

    async def health(self) -> dict[str, Any]:
        out: dict[str, Any] = await self._call("health")
        return out

    async def render_metrics(self, http_codes: Mapping[Any, int]) -> tuple[bytes, str]:
        out: tuple[bytes, str] = await self._call("render_metrics", dict(http_codes))
        return out

    async def close(self) -> None:
        await self._channel.close()
        if self._owns:
            with contextlib.suppress(Exception):
                await self.handle.close.remote()
