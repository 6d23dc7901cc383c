from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from wasma.transfer import Topology, TopologyBuilder, TopologyError, build_preset, load_topology
from wasma.transfer.discovery import parse_nvidia_smi_topo
from wasma.transfer.units import parse_bandwidth, parse_latency, parse_size

YAML = """
name: tiny
devices:
  - {name: n0.gpu0, kind: gpu, host: n0}
  - {name: n0.gpu1, kind: gpu, host: n0}
  - {name: n0.sw, kind: nvswitch, host: n0, throughput: 600GB/s}
links:
  - {a: n0.gpu0, b: n0.sw, bandwidth: 450GB/s, latency: 1us, kind: nvlink}
  - {a: n0.gpu1, b: n0.sw, bandwidth: 3600Gbps, latency: 0.001ms, kind: nvlink}
"""


def test_units() -> None:
    assert parse_bandwidth("400Gbps") == 50e9
    assert parse_bandwidth("400Gb/s") == 50e9
    assert parse_bandwidth("450GB/s") == 450e9
    assert parse_bandwidth("1GiB/s") == 2**30
    assert parse_bandwidth(7) == 7.0
    assert parse_latency("2us") == pytest.approx(2e-6)
    assert parse_latency("1.5ms") == pytest.approx(1.5e-3)
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("1e9") == 10**9
    for bad in ("fast", "10 furlongs/s"):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)
    with pytest.raises(ValueError):
        parse_size("1.5")


def test_yaml_with_units_round_trips() -> None:
    topo = Topology.from_yaml(YAML)
    assert sorted(topo.gpus()) == ["n0.gpu0", "n0.gpu1"]
    assert topo.link("n0.gpu1", "n0.sw").bandwidth_Bps == pytest.approx(450e9)
    assert topo.link("n0.gpu0", "n0.sw").latency_s == pytest.approx(1e-6)
    assert topo.device("n0.sw").throughput_Bps == pytest.approx(600e9)
    again = Topology.from_dict(topo.to_dict())
    assert again.to_dict() == topo.to_dict()


def test_yaml_file(tmp_path: pytest.TempPathFactory) -> None:
    path = tmp_path / "t.yaml"  # type: ignore[operator]
    path.write_text(YAML)
    assert load_topology(str(path)).name == "tiny"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda d: d["links"].append({"a": "n0.gpu0", "b": "n0.gpu9", "bandwidth": 1}),
            "unknown device 'n0.gpu9'",
        ),
        (lambda d: d["links"][0].update(bandwidth=-5), "bandwidth must be a positive"),
        (lambda d: d["links"][0].update(bandwidth=0), "bandwidth must be a positive"),
        (lambda d: d["links"][0].update(latency=-1), "latency must be"),
        (lambda d: d["links"].pop(), "no links: n0.gpu1"),
        (
            lambda d: (
                d["devices"].extend(
                    [
                        {"name": "n1.gpu0", "kind": "gpu", "host": "n1"},
                        {"name": "n1.sw", "kind": "nvswitch", "host": "n1"},
                    ]
                ),
                d["links"].append({"a": "n1.gpu0", "b": "n1.sw", "bandwidth": 1e9}),
            ),
            "disconnected: its GPUs fall into 2 groups",
        ),
        (
            lambda d: d["devices"].append({"name": "n0.gpu0", "kind": "gpu", "host": "n0"}),
            "duplicate device",
        ),
        (
            lambda d: d["devices"].append({"name": "x", "kind": "tpu", "host": "n0"}),
            "unknown kind 'tpu'",
        ),
        (lambda d: d["devices"].append({"name": "n1.gpu0", "kind": "gpu"}), "needs a 'host'"),
        (lambda d: d["links"].append(dict(d["links"][0])), "duplicate link"),
        (lambda d: d["links"][0].update(bandwidth="lots"), "cannot read bandwidth"),
        (lambda d: d["links"][0].update(kind="carrier-pigeon"), "unknown kind"),
        (lambda d: d["links"][0].pop("bandwidth"), "missing bandwidth"),
        (lambda d: d.pop("devices"), "non-empty 'devices'"),
    ],
)
def test_invalid_topologies_say_why(mutate: object, message: str) -> None:
    import yaml

    data = yaml.safe_load(YAML)
    mutate(data)  # type: ignore[operator]
    with pytest.raises(TopologyError, match=message):
        Topology.from_dict(data)


def test_isolated_gpu_and_no_gpu() -> None:
    builder = TopologyBuilder()
    builder.add_device("a", "gpu", "n0")
    builder.add_device("b", "gpu", "n0")
    with pytest.raises(TopologyError, match="no links"):
        builder.build()
    empty = TopologyBuilder()
    empty.add_device("s", "switch")
    with pytest.raises(TopologyError, match="no GPUs"):
        empty.build()


def test_bad_yaml_and_missing_file() -> None:
    with pytest.raises(TopologyError, match="not valid YAML"):
        Topology.from_yaml("devices: [\n  oops")
    with pytest.raises(TopologyError, match="neither a preset"):
        load_topology("/nonexistent/topo.yaml")


@pytest.mark.parametrize("name", ["hgx-h100", "hgx-h200"])
def test_hgx_presets(name: str) -> None:
    topo = load_topology(f"preset:{name}:2")
    assert len(topo.gpus()) == 16
    assert topo.hosts() == ["n0", "n1"]
    assert topo.link("n0.gpu3", "n0.nvswitch").bandwidth_Bps == 450e9
    nics = [d for d in topo.devices("nic") if d.host == "n1"]
    assert len(nics) == 8
    assert topo.link("n1.nic5", "leaf5").bandwidth_Bps == 50e9  # 400 Gb/s
    # Rail-optimised: every node's NIC i hangs off leaf i.
    assert set(topo.neighbors("leaf2")) >= {"n0.nic2", "n1.nic2"}


def test_pcie_preset_has_no_nvlink_and_single_node_no_fabric() -> None:
    topo = load_topology("preset:pcie-8")
    assert len(topo.gpus()) == 8
    assert not topo.devices("nvswitch")
    assert not topo.devices("switch")
    assert {link.kind for link in topo.links()} == {"pcie", "smp"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("preset:dgx-1", "unknown preset"),
        ("preset:hgx-h100:zero", "not an integer"),
        ("preset:hgx-h100:0", "must be >= 1"),
        ("preset:", "bad preset"),
    ],
)
def test_bad_presets(spec: str, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        load_topology(spec)


def test_unknown_device_names_a_hint() -> None:
    topo = build_preset("hgx-h100")
    with pytest.raises(TopologyError, match=r"unknown device 'n0\.gpu8'.*n0\.gpu0"):
        topo.require("n0.gpu8")
    with pytest.raises(TopologyError, match="is a nvswitch, not a gpu"):
        topo.require("n0.nvswitch", "gpu")


# nvidia-smi topo -m as printed on an HGX H100 (trimmed to 4 GPUs and 3 NICs).
HGX_TOPO = """\
\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tNIC2\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tNV18\tNV18\tPXB\tSYS\tSYS\t0-47,96-143\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tPXB\tSYS\tSYS\t0-47,96-143\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tSYS\tPXB\tNODE\t48-95,144-191\t1\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tSYS\tNODE\tPIX\t48-95,144-191\t1\t\tN/A
NIC0\tPXB\tPXB\tSYS\tSYS\t X \tSYS\tSYS
NIC1\tSYS\tSYS\tPXB\tNODE\tSYS\t X \tNODE
NIC2\tSYS\tSYS\tNODE\tPIX\tSYS\tNODE\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
  NIC2: mlx5_2
"""

# An older mesh (DGX-1 style): NVLinks only between some pairs, no NICs.
MESH_TOPO = """\
        GPU0    GPU1    GPU2    CPU Affinity    NUMA Affinity
GPU0     X      NV1     NV2     0-19    0
GPU1    NV1      X      SYS     0-19    0
GPU2    NV2     SYS      X      20-39   1
"""


def test_discovery_hgx_builds_nvswitch_and_pcie_groups() -> None:
    topo = parse_nvidia_smi_topo(HGX_TOPO, host="n3")
    assert sorted(topo.gpus()) == [f"n3.gpu{i}" for i in range(4)]
    assert topo.link("n3.gpu2", "n3.nvswitch").bandwidth_Bps == 18 * 25e9
    # GPU0, GPU1 and NIC0 share a PCIe switch (PXB); GPU3 and NIC2 (PIX) another.
    switch = next(n for n in topo.neighbors("n3.nic0") if "pcie" in n)
    assert set(topo.neighbors(switch)) >= {"n3.gpu0", "n3.gpu1"}
    switch3 = next(n for n in topo.neighbors("n3.gpu3") if "pcie" in n)
    assert "n3.nic2" in topo.neighbors(switch3)
    assert topo.host_of("n3.nic1") == "n3"
    # Two NUMA nodes, joined by the SMP link.
    assert {d.name for d in topo.devices("cpu")} == {"n3.cpu0", "n3.cpu1"}
    assert topo.link("n3.cpu0", "n3.cpu1").kind == "smp"
    # 18 NVLinks a GPU: a Hopper NVSwitch, which multicasts (NVLS); unless told otherwise.
    assert topo.can_multicast("n3.nvswitch")
    told = parse_nvidia_smi_topo(HGX_TOPO, host="n3", nvswitch_multicast=False)
    assert not told.can_multicast("n3.nvswitch")
    older = parse_nvidia_smi_topo(HGX_TOPO.replace("NV18", "NV12"), host="n3")
    assert not older.can_multicast("n3.nvswitch")


def test_discovery_mesh_uses_direct_nvlinks() -> None:
    topo = parse_nvidia_smi_topo(MESH_TOPO)
    assert not topo.devices("nvswitch")
    assert topo.link("n0.gpu0", "n0.gpu2").bandwidth_Bps == 2 * 25e9
    assert topo.link("n0.gpu0", "n0.gpu1").bandwidth_Bps == 25e9
    with pytest.raises(TopologyError):
        topo.link("n0.gpu1", "n0.gpu2")


def test_discovery_rejects_garbage() -> None:
    with pytest.raises(TopologyError, match="no header row"):
        parse_nvidia_smi_topo("No devices were found\n")
    truncated = "\n".join(MESH_TOPO.splitlines()[:2]) + "\n"
    with pytest.raises(TopologyError, match="no row for GPU1"):
        parse_nvidia_smi_topo(truncated)


def test_asymmetric_link_round_trips_and_prices_each_direction() -> None:
    from wasma.transfer import Planner

    text = YAML.replace(
        "kind: nvlink}\n  - {a: n0.gpu1", "kind: nvlink, bandwidth_back: 45GB/s}\n  - {a: n0.gpu1"
    )
    topo = Topology.from_yaml(text)
    assert topo.link("n0.gpu0", "n0.sw").bandwidth_Bps == pytest.approx(450e9)
    assert topo.link("n0.sw", "n0.gpu0").bandwidth_Bps == pytest.approx(45e9)
    assert Topology.from_dict(topo.to_dict()).to_dict() == topo.to_dict()
    # Lift the switch's own cap so only the links differ.
    planner = Planner(Topology.from_yaml(text.replace("600GB/s", "6000GB/s")))
    into_gpu0 = planner.plan("n0.gpu1", ["n0.gpu0"], 1 << 30).predicted_s
    out_of_gpu0 = planner.plan("n0.gpu0", ["n0.gpu1"], 1 << 30).predicted_s
    assert into_gpu0 == pytest.approx(10 * out_of_gpu0, rel=0.01)


def test_cpu_cluster_preset_caps_concurrent_copies() -> None:
    from wasma.transfer import Planner
    from wasma.transfer.presets import build_cpu_cluster

    topo = build_cpu_cluster(2, 3, copy_Bps=4e9, cores=2, tcp_Bps=1e9)
    assert topo.hosts() == ["n0", "n1"]
    planner = Planner(topo, per_message_s=0.0)
    one = planner.plan("n0.gpu0", ["n0.gpu1"], 4 * 10**9, algorithms=["direct"])
    assert one.predicted_s == pytest.approx(1.0)  # one copy at copy_Bps
    two = planner.plan("n0.gpu0", ["n0.gpu1", "n0.gpu2"], 4 * 10**9, algorithms=["direct"])
    assert two.predicted_s == pytest.approx(1.0)  # two copies, two cores
    remote = planner.plan("n0.gpu0", ["n1.gpu0"], 10**9, algorithms=["direct"])
    assert remote.predicted_s == pytest.approx(1.0, rel=1e-3)  # the LAN


def test_cpu_cluster_memory_bandwidth_caps_concurrent_copies() -> None:
    from wasma.transfer import Planner
    from wasma.transfer.presets import build_cpu_cluster

    # Two cores, but memory sustains only 1.5 copies' worth: two copies at once share it.
    topo = build_cpu_cluster(1, 4, copy_Bps=4e9, cores=2, memory_Bps=6e9)
    planner = Planner(topo, per_message_s=0.0)
    one = planner.plan("n0.gpu0", ["n0.gpu1"], 4 * 10**9, algorithms=["direct"])
    assert one.predicted_s == pytest.approx(1.0)  # alone, a copy runs at copy_Bps
    two = planner.plan("n0.gpu0", ["n0.gpu1", "n0.gpu2"], 3 * 10**9, algorithms=["direct"])
    assert two.predicted_s == pytest.approx(1.0)  # 6 GB at 6 GB/s, not 0.75 s
    # Above cores x copy_Bps the cores are the limit.
    roomy = build_cpu_cluster(1, 4, copy_Bps=4e9, cores=2, memory_Bps=1e12)
    fan = Planner(roomy, per_message_s=0.0).plan(
        "n0.gpu0", ["n0.gpu1", "n0.gpu2"], 4 * 10**9, algorithms=["direct"]
    )
    assert fan.predicted_s == pytest.approx(1.0)
    with pytest.raises(TopologyError):
        build_cpu_cluster(memory_Bps=0.0)


@pytest.mark.parametrize(
    ("parse", "value"),
    [
        (parse_size, "1e400"),
        (parse_size, True),
        (parse_bandwidth, [1]),
        (parse_bandwidth, 10**400),
        (parse_bandwidth, "1e400Gbps"),
        (parse_latency, {"a": 1}),
        (parse_latency, float("nan")),
    ],
    ids=["size-1e400", "size-bool", "bw-list", "bw-huge-int", "bw-1e400", "lat-dict", "lat-nan"],
)
def test_values_no_unit_parser_can_read_are_value_errors(parse: Any, value: Any) -> None:
    with pytest.raises(ValueError) as ei:
        parse(value)
    assert len(str(ei.value)) < 80  # one short line, even for a 400-digit number


def test_a_topology_that_is_a_folder_or_not_text_is_a_topology_error(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="Is a directory"):
        Topology.from_yaml(tmp_path)
    (tmp_path / "t.yaml").write_bytes(b"name: \xff\n")
    with pytest.raises(TopologyError, match="not UTF-8 text"):
        Topology.from_yaml(tmp_path / "t.yaml")


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        (
            YAML.replace("latency: 1us", "latncy: 1us", 1),
            r"links\[0\]: unknown key\(s\) \['latncy'\]",
        ),
        (YAML.replace("host: n0}", "hots: n0}", 1), r"devices\[0\]: unknown key\(s\) \['hots'\]"),
        (YAML + "extra: 1\n", r"topology: unknown key\(s\) \['extra'\]"),
        ("devices: [1,\n", r"not valid YAML at line \d+, column \d+"),
    ],
)
def test_a_topology_file_error_names_the_file_and_the_key(
    tmp_path: Path, text: str, pattern: str
) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(TopologyError, match=r"topology file .*t\.yaml: .*" + pattern) as ei:
        Topology.from_yaml(path)
    assert "\n" not in str(ei.value)
