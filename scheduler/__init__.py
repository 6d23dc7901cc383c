"""The scheduler: workflow DAGs, cluster state, prefix index, policies and the router."""

from wasma.scheduler.copies import Booking, CopySchedule
from wasma.scheduler.policy import Placement, PlacementKind, Policy, PolicyContext, RequestInfo
from wasma.scheduler.prefix_index import PrefixIndex
from wasma.scheduler.registry import PolicyRegistry, UnknownPolicy, default_registry
from wasma.scheduler.router import Router
from wasma.scheduler.state import ClusterState, EngineLoad
from wasma.scheduler.trace import TraceError, load_trace, write_trace
from wasma.scheduler.workflow import Workflow, WorkflowError
from wasma.scheduler.workflows import WorkflowRegistry

__all__ = [
    "Booking",
    "ClusterState",
    "CopySchedule",
    "EngineLoad",
    "Placement",
    "PlacementKind",
    "Policy",
    "PolicyContext",
    "PolicyRegistry",
    "PrefixIndex",
    "RequestInfo",
    "Router",
    "TraceError",
    "UnknownPolicy",
    "Workflow",
    "WorkflowError",
    "WorkflowRegistry",
    "default_registry",
    "load_trace",
    "write_trace",
]
