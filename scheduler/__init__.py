"""The scheduler: workflow DAGs, cluster state, prefix index, policies and the router."""

from scheduler.copies import Booking, CopySchedule
from scheduler.policy import Placement, PlacementKind, Policy, PolicyContext, RequestInfo
from scheduler.prefix_index import PrefixIndex
from scheduler.registry import PolicyRegistry, UnknownPolicy, default_registry
from scheduler.router import Router
from scheduler.state import ClusterState, EngineLoad
from scheduler.trace import TraceError, load_trace, write_trace
from scheduler.workflow import Workflow, WorkflowError
from scheduler.workflows import WorkflowRegistry

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
