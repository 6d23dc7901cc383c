"""Run the planner's tree-packing schedule through torch.distributed and check the bytes.

    python -m wasma.transfer.nccl_check [--backend auto|nccl|gloo] [--bytes 64MiB] [--gpus N]

On a machine with two or more GPUs (`auto` picks NCCL there) it broadcasts from GPU 0 to
the others of an HGX H200 node as `flow_trees` plans it, one rank per GPU, and prints the
measured time beside the plan's prediction and bound; elsewhere it runs the same plan over
gloo in host memory, which checks the schedule's correctness, not its speed. Exit status
0 when every destination holds exactly the source's bytes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from wasma.transfer.planner import Planner
from wasma.transfer.presets import build_preset
from wasma.transfer.torch_executor import TorchDistExecutor, torch_available
from wasma.transfer.units import format_seconds, parse_size


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    parser.add_argument("--bytes", default=None, help="default: 64MiB on NCCL, 4MiB on gloo")
    parser.add_argument("--gpus", type=int, default=None, help="ranks (default: GPUs, or 4)")
    args = parser.parse_args(argv)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch_available("nccl") else "gloo"
    if not torch_available(backend):
        print(
            f"nccl_check: torch.distributed backend {backend} is not usable here", file=sys.stderr
        )
        return 2
    ranks = args.gpus
    if ranks is None:
        import torch

        ranks = min(8, torch.cuda.device_count()) if backend == "nccl" else 4
    if not 2 <= ranks <= 8:
        print("nccl_check: --gpus must be 2..8", file=sys.stderr)
        return 2
    num_bytes = parse_size(args.bytes or ("64MiB" if backend == "nccl" else "4MiB"))
    planner = Planner(build_preset("hgx-h200"))
    dsts = [f"n0.gpu{g}" for g in range(1, ranks)]
    plan = planner.plan("n0.gpu0", dsts, num_bytes, algorithms=["flow_trees"])
    if len(plan.devices) > ranks:
        print(f"nccl_check: the plan relays through {plan.devices}, more than {ranks} ranks")
        return 2
    gpu_of = {device: int(device.rsplit("gpu", 1)[1]) for device in plan.devices}
    executor = TorchDistExecutor(backend, gpu_of=gpu_of)
    result = executor.run(plan, timeout_s=300)
    print(
        f"{backend}: {len(plan.hops)} hops in {plan.chunks} pieces each to {len(dsts)} GPUs; "
        f"measured {format_seconds(result.elapsed_s)}, predicted "
        f"{format_seconds(plan.predicted_s)}, bound {format_seconds(plan.bound_s or 0.0)}; "
        f"verified={result.verified}"
    )
    return 0 if result.verified else 1


if __name__ == "__main__":
    raise SystemExit(main())
