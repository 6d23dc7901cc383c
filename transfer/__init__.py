"""Topology-aware KV transfer between engines: the cluster topology, a collective planner
under the alpha-beta model, executors that move the bytes, and overlap accounting."""

from transfer.cli import plan_main
from transfer.costmodel import LinkTable, fit_alpha_beta
from transfer.cpu_executor import CpuExecutor
from transfer.discovery import discover_local, parse_nvidia_smi_topo
from transfer.executor import ExecutionResult, Executor, TransferFailed
from transfer.kv_peer import PeerError, PeerServer, PeerStore
from transfer.overlap import exposed_per_layer_s, exposed_s, layer_transfer_times_s
from transfer.plan import Hop, TransferPlan
from transfer.planner import ALGORITHMS, Planner
from transfer.presets import build_cpu_cluster, build_preset, load_topology
from transfer.pricing import BandwidthPricer, LinkModel, TransferPricer
from transfer.topology import Device, Link, Topology, TopologyBuilder, TopologyError
from transfer.torch_executor import TorchDistExecutor, torch_available

__all__ = [
    "ALGORITHMS",
    "BandwidthPricer",
    "CpuExecutor",
    "Device",
    "ExecutionResult",
    "Executor",
    "Hop",
    "Link",
    "LinkModel",
    "LinkTable",
    "PeerError",
    "PeerServer",
    "PeerStore",
    "Planner",
    "Topology",
    "TopologyBuilder",
    "TopologyError",
    "TorchDistExecutor",
    "TransferFailed",
    "TransferPlan",
    "TransferPricer",
    "build_cpu_cluster",
    "build_preset",
    "discover_local",
    "exposed_per_layer_s",
    "exposed_s",
    "fit_alpha_beta",
    "layer_transfer_times_s",
    "load_topology",
    "parse_nvidia_smi_topo",
    "plan_main",
    "torch_available",
]
# transfer.vllm_connector (the vLLM KV connector) is not imported here: it needs vLLM, and
# vLLM loads it by module path.
