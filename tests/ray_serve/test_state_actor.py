"""The scheduling actor, on a real local Ray: it outlives the replica that created it.

A `WasmaLLMServer` replica may be the first to ask for its deployment's scheduling actor
(to get its KV events endpoint). Serve runs replicas in placement groups that capture
their children, and removes a killed replica's group: an actor created inside it would
die with the replica, and every later decision of the deployment with it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def test_scheduling_actor_created_in_a_replicas_group_survives_the_group(
    local_ray: None,
) -> None:
    from ray.serve._private.common import DeploymentID
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=1)
    class Replica:
        """Stands where a Serve replica stands: in a group capturing its children."""

        def create(self) -> Any:
            from wasma.ray_serve.router import scheduling_actor

            self.state = scheduling_actor(
                DeploymentID(name="tiny", app_name="pg-test"), state_name="pg-test-state"
            )
            return ray.get(self.state.kv_index.remote())

    group = placement_group([{"CPU": 1}])
    ray.get(group.ready(), timeout=60)
    replica = Replica.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_capture_child_tasks=True
        )
    ).remote()
    assert ray.get(replica.create.remote(), timeout=120) == {}
    ray.kill(replica)
    remove_placement_group(group)
    state = ray.get_actor("pg-test-state", namespace="serve")
    try:
        # Still answering once the group (and every actor in it) is gone.
        assert ray.get(state.kv_index.remote(), timeout=60) == {}
    finally:
        ray.kill(state)
