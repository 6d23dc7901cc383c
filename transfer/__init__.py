"""Topology-aware KV transfer between engines: the cluster topology, a collective planner
under the alpha-beta model, executors that move the bytes, and overlap accounting."""

from wasma.transfer.cli import plan_main
from wasma.transfer.costmodel import LinkTable, fit_alpha_beta
from wasma.transfer.cpu_executor import CpuExecutor
from wasma.transfer.discovery import discover_local, parse_nvidia_smi_topo
from wasma.transfer.executor import ExecutionResult, Executor, TransferFailed
from wasma.transfer.kv_peer import PeerError, PeerServer, PeerStore
from wasma.transfer.overlap import exposed_per_layer_s, exposed_s, layer_transfer_times_s
from wasma.transfer.packing import FlowNetwork, Packing
from wasma.transfer.plan import Hop, Span, TransferPlan, even_spans
from wasma.transfer.planner import ALGORITHMS, Planner
from wasma.transfer.presets import build_cpu_cluster, build_preset, load_topology
from wasma.transfer.pricing import BandwidthPricer, LinkModel, TransferPricer
from wasma.transfer.topology import Device, Link, Topology, TopologyBuilder, TopologyError
from wasma.transfer.torch_executor import TorchDistExecutor, torch_available

__all__ = [
    "ALGORITHMS",
    "BandwidthPricer",
    "CpuExecutor",
    "Device",
    "ExecutionResult",
    "Executor",
    "FlowNetwork",
    "Hop",
    "Link",
    "LinkModel",
    "LinkTable",
    "Packing",
    "PeerError",
    "PeerServer",
    "PeerStore",
    "Planner",
    "Span",
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
    "even_spans",
    "exposed_per_layer_s",
    "exposed_s",
    "fit_alpha_beta",
    "layer_transfer_times_s",
    "load_topology",
    "parse_nvidia_smi_topo",
    "plan_main",
    "torch_available",
]
# wasma.transfer.vllm_connector (the vLLM KV connector) is not imported here: it needs vLLM, and
# vLLM loads it by module path.
