"""The cluster as a graph: devices (GPUs, switches, NICs, CPUs) and full-duplex links.

Every link carries `bandwidth` in bytes/s *per direction* and a one-way `latency` in
seconds. Planners treat each direction of a link as its own resource, as NVLink, PCIe and
Ethernet/InfiniBand all are full duplex.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import yaml

from wasma.transfer.units import parse_bandwidth, parse_latency

# What a node can be. GPUs are the endpoints that hold KV; everything else only forwards.
DEVICE_KINDS = frozenset({"gpu", "nvswitch", "pcie_switch", "cpu", "nic", "switch"})
LINK_KINDS = frozenset({"nvlink", "pcie", "network", "smp", "memory"})


class TopologyError(ValueError):
    """The topology (or a device named against it) is invalid; the message says why."""


@dataclass(frozen=True)
class Link:
    u: str
    v: str
    bandwidth_Bps: float  # bytes per second, u -> v (and v -> u unless set below)
    latency_s: float  # one way
    kind: str
    bandwidth_back_Bps: float | None = None  # v -> u, when the two directions differ

    @property
    def back_Bps(self) -> float:
        return self.bandwidth_Bps if self.bandwidth_back_Bps is None else self.bandwidth_back_Bps


@dataclass(frozen=True)
class Device:
    name: str
    kind: str
    host: str  # the machine it sits in; network switches use their own name
    # Total bytes/s all transfers through this device share (a switch backplane, or the
    # CPU cores doing copies); None: unlimited, only its links constrain.
    throughput_Bps: float | None = None
    # Replicates what one link brings in onto several of its out-links (NVLink SHARP on
    # an H100/H200 NVSwitch: NCCL's NVLS algorithms): a sender's piece crosses its link
    # into the switch once, whatever the number of GPUs it reaches there.
    multicast: bool = False


class Topology:
    """A validated, read-only view of a cluster graph. Build it with `TopologyBuilder`,
    `Topology.from_dict`, `Topology.from_yaml` or the presets."""

    def __init__(self, graph: nx.Graph, name: str = "topology") -> None:
        self.name = name
        # True when every host `n{k}` is wired alike (a preset): a GPU pair's transfer
        # price then depends only on its GPU indices and whether it shares a host.
        self.hosts_alike = False
        # Relabellings of devices that may map the topology onto itself (declared by the
        # presets; each is checked against the links before use, transfer/symmetry.py).
        self.symmetries: list[dict[str, str]] = []
        self._graph = graph.copy()
        validate_graph(self._graph)
        self._graph.graph["frozen"] = True

    # construction ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        """From `{"name", "devices": [{name, kind, host}], "links": [{a, b, bandwidth,
        latency, kind}]}`; bandwidth and latency may carry units ('400Gbps', '2us')."""
        if not isinstance(data, Mapping):
            raise TopologyError("topology must be a mapping with 'devices' and 'links'")
        # A misspelt key ('latncy') would otherwise be dropped, and its default used.
        _only(data, {"name", "devices", "links"}, "topology")
        builder = TopologyBuilder(str(data.get("name", "topology")))
        devices = data.get("devices")
        links = data.get("links")
        if not isinstance(devices, list) or not devices:
            raise TopologyError("topology needs a non-empty 'devices' list")
        if not isinstance(links, list):
            raise TopologyError("topology needs a 'links' list")
        for i, entry in enumerate(devices):
            if not isinstance(entry, Mapping) or "name" not in entry or "kind" not in entry:
                raise TopologyError(f"devices[{i}] needs 'name' and 'kind'")
            _only(entry, {"name", "kind", "host", "throughput", "multicast"}, f"devices[{i}]")
            multicast = entry.get("multicast", False)
            if not isinstance(multicast, bool):
                raise TopologyError(f"devices[{i}]: 'multicast' must be true or false")
            throughput = entry.get("throughput")
            try:
                throughput_Bps = None if throughput is None else parse_bandwidth(throughput)
            except ValueError as exc:
                raise TopologyError(f"devices[{i}]: {exc}") from None
            builder.add_device(
                str(entry["name"]),
                str(entry["kind"]),
                entry.get("host"),
                throughput_Bps=throughput_Bps,
                multicast=multicast,
            )
        for i, entry in enumerate(links):
            if not isinstance(entry, Mapping):
                raise TopologyError(f"links[{i}] must be a mapping")
            _only(entry, _LINK_KEYS, f"links[{i}]")
            missing = [key for key in ("a", "b", "bandwidth") if key not in entry]
            if missing:
                raise TopologyError(f"links[{i}] is missing {', '.join(missing)}")
            try:
                bandwidth = parse_bandwidth(entry["bandwidth"])
                latency = parse_latency(entry.get("latency", 0.0))
                back = entry.get("bandwidth_back")
                back_Bps = None if back is None else parse_bandwidth(back)
            except ValueError as exc:
                raise TopologyError(f"links[{i}]: {exc}") from None
            builder.add_link(
                str(entry["a"]),
                str(entry["b"]),
                bandwidth,
                latency,
                str(entry.get("kind", "network")),
                bandwidth_back_Bps=back_Bps,
            )
        return builder.build()

    @classmethod
    def from_yaml(cls, source: str | Path) -> Topology:
        """From a YAML file path, or YAML text when `source` contains a newline."""
        where = "topology"
        if isinstance(source, Path) or "\n" not in source:
            path = Path(source)
            where = f"topology file {path}"
            if not path.exists():
                raise TopologyError(f"topology file not found: {path}")
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
                raise TopologyError(f"topology file {path}: {reason or exc}") from None
        else:
            text = source
        try:
            data = yaml.safe_load(text)
        except (yaml.YAMLError, ValueError) as exc:  # ValueError: an int too long to read
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise TopologyError(f"{where}: not valid YAML{at}: {problem}") from None
        try:
            return cls.from_dict(data)
        except TopologyError as exc:
            if where == "topology":
                raise
            raise TopologyError(f"{where}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "devices": [
                {"name": d.name, "kind": d.kind, "host": d.host}
                | ({"throughput": d.throughput_Bps} if d.throughput_Bps else {})
                | ({"multicast": True} if d.multicast else {})
                for d in self.devices()
            ],
            "links": [
                {
                    "a": link.u,
                    "b": link.v,
                    "bandwidth": link.bandwidth_Bps,
                    "latency": link.latency_s,
                    "kind": link.kind,
                }
                | (
                    {"bandwidth_back": link.bandwidth_back_Bps}
                    if link.bandwidth_back_Bps is not None
                    else {}
                )
                for link in self.links()
            ],
        }

    # queries -----------------------------------------------------------------------------
    @property
    def graph(self) -> nx.Graph:
        """A copy, so callers cannot break the validated model."""
        return self._graph.copy()

    def devices(self, kind: str | None = None) -> list[Device]:
        return [
            Device(
                name,
                attrs["kind"],
                attrs["host"],
                attrs.get("throughput"),
                bool(attrs.get("multicast", False)),
            )
            for name, attrs in self._graph.nodes(data=True)
            if kind is None or attrs["kind"] == kind
        ]

    def gpus(self) -> list[str]:
        return [d.name for d in self.devices("gpu")]

    def hosts(self) -> list[str]:
        return sorted({d.host for d in self.devices("gpu")})

    def __contains__(self, name: object) -> bool:
        return name in self._graph

    def device(self, name: str) -> Device:
        self.require(name)
        attrs = self._graph.nodes[name]
        return Device(
            name,
            attrs["kind"],
            attrs["host"],
            attrs.get("throughput"),
            bool(attrs.get("multicast", False)),
        )

    def can_multicast(self, name: str) -> bool:
        """Whether `name` replicates a piece onto several out-links (`Device.multicast`)."""
        self.require(name)
        return bool(self._graph.nodes[name].get("multicast", False))

    def require(self, name: str, kind: str | None = None) -> None:
        """Raise TopologyError naming the device if it is absent (or not of `kind`)."""
        if name not in self._graph:
            hint = ", ".join(sorted(self.gpus())[:4])
            raise TopologyError(f"unknown device {name!r} (GPUs are named like {hint}, ...)")
        if kind is not None and self._graph.nodes[name]["kind"] != kind:
            raise TopologyError(
                f"device {name!r} is a {self._graph.nodes[name]['kind']}, not a {kind}"
            )

    def host_of(self, name: str) -> str:
        self.require(name)
        return str(self._graph.nodes[name]["host"])

    def kind_of(self, name: str) -> str:
        self.require(name)
        return str(self._graph.nodes[name]["kind"])

    def link(self, u: str, v: str) -> Link:
        if not self._graph.has_edge(u, v):
            raise TopologyError(f"no link between {u!r} and {v!r}")
        link = _link(u, v, self._graph.edges[u, v])
        if link.u == u:
            return link
        return Link(
            u,
            v,
            link.back_Bps,
            link.latency_s,
            link.kind,
            None if link.bandwidth_back_Bps is None else link.bandwidth_Bps,
        )

    def links(self) -> list[Link]:
        return [_link(u, v, attrs) for u, v, attrs in self._graph.edges(data=True)]

    def neighbors(self, name: str) -> list[str]:
        return list(self._graph.neighbors(name))

    def __repr__(self) -> str:
        return (
            f"Topology({self.name!r}, {len(self.gpus())} GPUs, {len(self.hosts())} hosts, "
            f"{self._graph.number_of_edges()} links)"
        )


class TopologyBuilder:
    """Accumulates devices and links, checking each as it is added; `build()` validates the
    whole (connectivity) and returns an immutable `Topology`."""

    def __init__(self, name: str = "topology") -> None:
        self.name = name
        self._graph = nx.Graph()

    def add_device(
        self,
        name: str,
        kind: str,
        host: str | None = None,
        *,
        throughput_Bps: float | None = None,
        multicast: bool = False,
    ) -> str:
        if not name:
            raise TopologyError("device names must be non-empty")
        if kind not in DEVICE_KINDS:
            raise TopologyError(
                f"device {name!r} has unknown kind {kind!r} "
                f"(expected one of {', '.join(sorted(DEVICE_KINDS))})"
            )
        if name in self._graph:
            raise TopologyError(f"duplicate device {name!r}")
        if throughput_Bps is not None and not 0 < throughput_Bps < float("inf"):
            raise TopologyError(
                f"device {name!r}: throughput must be a positive number of "
                f"bytes/s, got {throughput_Bps!r}"
            )
        if multicast and kind == "gpu":
            # A GPU that copies to several peers sends each copy: hops, not a switch.
            raise TopologyError(f"device {name!r}: only switches multicast, not GPUs")
        if host is None:
            if kind == "gpu":
                raise TopologyError(f"GPU {name!r} needs a 'host'")
            host = name
        self._graph.add_node(
            name, kind=kind, host=str(host), throughput=throughput_Bps, multicast=bool(multicast)
        )
        return name

    def add_link(
        self,
        a: str,
        b: str,
        bandwidth_Bps: float,
        latency_s: float = 0.0,
        kind: str = "network",
        *,
        bandwidth_back_Bps: float | None = None,
    ) -> None:
        """A full-duplex link; `bandwidth_Bps` each way unless `bandwidth_back_Bps` gives
        b -> a separately."""
        for end in (a, b):
            if end not in self._graph:
                raise TopologyError(f"link {a} -- {b}: unknown device {end!r}")
        if a == b:
            raise TopologyError(f"link {a} -- {b}: a device cannot link to itself")
        if self._graph.has_edge(a, b):
            raise TopologyError(f"duplicate link {a} -- {b}")
        for value in (bandwidth_Bps, bandwidth_back_Bps):
            if value is not None and (not value > 0 or value == float("inf")):
                raise TopologyError(
                    f"link {a} -- {b}: bandwidth must be a positive finite number of "
                    f"bytes/s, got {value!r}"
                )
        if not latency_s >= 0 or latency_s == float("inf"):
            raise TopologyError(
                f"link {a} -- {b}: latency must be a finite number of seconds >= 0, "
                f"got {latency_s!r}"
            )
        if kind not in LINK_KINDS:
            raise TopologyError(
                f"link {a} -- {b}: unknown kind {kind!r} "
                f"(expected one of {', '.join(sorted(LINK_KINDS))})"
            )
        self._graph.add_edge(
            a,
            b,
            a=a,
            bandwidth=float(bandwidth_Bps),
            latency=float(latency_s),
            kind=kind,
            back=bandwidth_back_Bps,
        )

    def add_links(
        self, pairs: Iterable[tuple[str, str]], bandwidth_Bps: float, latency_s: float, kind: str
    ) -> None:
        for a, b in pairs:
            self.add_link(a, b, bandwidth_Bps, latency_s, kind)

    def build(self) -> Topology:
        return Topology(self._graph, self.name)


def _link(u: str, v: str, attrs: Mapping[str, Any]) -> Link:
    # Undirected graphs forget endpoint order; the declared first end is kept in "a".
    first = attrs.get("a", u)
    second = v if first == u else u
    return Link(
        first, second, attrs["bandwidth"], attrs["latency"], attrs["kind"], attrs.get("back")
    )


def validate_graph(graph: nx.Graph) -> None:
    """Check what a planner relies on: known kinds, sane numbers, GPUs all reachable."""
    gpus = [n for n, attrs in graph.nodes(data=True) if attrs.get("kind") == "gpu"]
    if not gpus:
        raise TopologyError("topology has no GPUs")
    for node, attrs in graph.nodes(data=True):
        if attrs.get("kind") not in DEVICE_KINDS:
            raise TopologyError(f"device {node!r} has unknown kind {attrs.get('kind')!r}")
        if not attrs.get("host"):
            raise TopologyError(f"device {node!r} has no host")
    for u, v, attrs in graph.edges(data=True):
        back = attrs.get("back")
        if back is not None and (not isinstance(back, int | float) or not 0 < back < float("inf")):
            raise TopologyError(f"link {u} -- {v}: bandwidth must be positive, got {back!r}")
        bandwidth = attrs.get("bandwidth")
        latency = attrs.get("latency")
        if not isinstance(bandwidth, int | float) or not 0 < bandwidth < float("inf"):
            raise TopologyError(f"link {u} -- {v}: bandwidth must be positive, got {bandwidth!r}")
        if not isinstance(latency, int | float) or not 0 <= latency < float("inf"):
            raise TopologyError(f"link {u} -- {v}: latency must be >= 0, got {latency!r}")
    isolated = [g for g in gpus if graph.degree(g) == 0]
    if isolated:
        raise TopologyError(f"GPU(s) with no links: {', '.join(sorted(isolated)[:8])}")
    components = [c for c in nx.connected_components(graph) if c & set(gpus)]
    if len(components) > 1:
        groups = "; ".join(
            ", ".join(sorted(c & set(gpus))[:3]) + (" ..." if len(c & set(gpus)) > 3 else "")
            for c in components
        )
        raise TopologyError(
            f"topology is disconnected: its GPUs fall into {len(components)} groups that "
            f"cannot reach each other: {groups}"
        )


_LINK_KEYS = {"a", "b", "bandwidth", "bandwidth_back", "latency", "kind"}


def _only(entry: Mapping[Any, Any], known: set[str], where: str) -> None:
    unknown = set(entry) - known
    if unknown:
        raise TopologyError(
            f"{where}: unknown key(s) {sorted(unknown, key=str)}; known: {sorted(known)}"
        )
