from __future__ import annotations

from dataclasses import replace

import pytest

from wasma.transfer import Planner, TransferPlan, build_preset
from wasma.transfer.algorithms import with_chunks
from wasma.transfer.executor import TransferFailed
from wasma.transfer.torch_executor import TorchDistExecutor, schedule_waves, torch_available

SIZE = 300_001


def _plan(algorithm: str, src: str, dsts: list[str], chunks: int) -> TransferPlan:
    plan = Planner(build_preset("hgx-h100", 2)).plan(src, dsts, SIZE, algorithms=[algorithm])
    return replace(plan, hops=tuple(with_chunks(plan.hops, chunks)), chunks=chunks)


def test_waves_pipeline_a_chain_and_respect_rounds() -> None:
    chain = _plan("chain", "n0.gpu0", ["n0.gpu1", "n1.gpu0", "n1.gpu1"], 4)
    waves = schedule_waves(chain.hops)
    # Hop h moves piece c in wave h + c: forwarding overlaps receiving.
    assert [[op.wave for op in ops] for ops in waves] == [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5]]
    tree = _plan("binomial_tree", "n0.gpu0", ["n0.gpu1", "n1.gpu0", "n1.gpu1"], 1)
    tree_waves = [ops[0].wave for ops in schedule_waves(tree.hops)]
    assert tree_waves == [h.stage for h in tree.hops]  # one round, one wave


needs_gloo = pytest.mark.skipif(not torch_available("gloo"), reason="no torch gloo backend")


@needs_gloo
@pytest.mark.parametrize(
    ("algorithm", "dsts", "chunks"),
    [
        ("direct", ["n1.gpu0"], 1),
        ("chain", ["n0.gpu1", "n1.gpu0", "n1.gpu1"], 4),
        ("packed_trees", ["n0.gpu1", "n1.gpu0", "n1.gpu1"], 3),
        ("binomial_tree", ["n0.gpu1", "n1.gpu0", "n1.gpu1"], 1),
        ("rail_stripe", ["n1.gpu5"], 2),
        ("flow_trees", ["n0.gpu1", "n0.gpu2", "n0.gpu3"], 3),
        ("rail_trees", ["n0.gpu1", "n0.gpu2", "n0.gpu3"], 3),  # one multicast, a PCIe chain
    ],
)
def test_gloo_runs_plans(algorithm: str, dsts: list[str], chunks: int) -> None:
    plan = _plan(algorithm, "n0.gpu0", dsts, chunks)
    # Generous: spawning torch ranks on a busy 2-core box takes a while; this catches hangs.
    result = TorchDistExecutor("gloo").run(plan, timeout_s=240)
    assert result.verified and result.backend == "torch-gloo"
    assert len(result.hop_finish_s) == len(plan.hops)


@needs_gloo
def test_gloo_rank_dying_fails_cleanly() -> None:
    plan = _plan("chain", "n0.gpu0", ["n0.gpu1", "n1.gpu0"], 3)
    with pytest.raises(TransferFailed):
        TorchDistExecutor("gloo", crash_hop=0).run(plan, timeout_s=20)


@pytest.mark.skipif(not torch_available("nccl"), reason="NCCL needs two or more GPUs")
def test_nccl_chain_on_gpus() -> None:
    plan = _plan("chain", "n0.gpu0", ["n0.gpu1"], 4)
    assert TorchDistExecutor("nccl").run(plan, timeout_s=120).verified


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="backend"):
        TorchDistExecutor("mpi")
