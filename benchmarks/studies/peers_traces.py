"""Small versions of the three apps for the peers benchmark, and a text-prompt replayer.

`wasma.benchmarks.apps` sizes its workflows for an 8B model on a GPU (documents of 6000
tokens); the tiny model has a 2048-token context here and two shared CPU cores. These
keep each app's shape (which nodes share which prefix, who continues whose conversation)
at about a sixth of the size. Deadlines are `slack` x the workflow's critical path run
alone, priced by the simulator profile, plus a per-node allowance for the HTTP hops the
profile (fitted in-process) does not see.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from wasma.benchmarks.apps import critical_path_alone_s, node, sized
from wasma.benchmarks.replay import Replayer
from wasma.core.profile import Profile
from wasma.scheduler.workflow import ContextOf, Node, OutputOf, Segment, Shared, Unique, Workflow

AppBuilder = Callable[[np.random.Generator, str], list[Node]]


def _n(rng: np.random.Generator, mean: int, spread: float = 0.4) -> int:
    return sized(rng, mean, spread)  # narrower than the full-size apps by default


def small_pipeline(rng: np.random.Generator, wid: str) -> list[Node]:
    """pm -> architect -> 2-3 engineers (continuing the architect) -> reviewer."""
    engineers = int(rng.integers(2, 4))
    nodes = [
        node("pm", [], _n(rng, 40), [Shared("sys:pm", 384), Unique(_n(rng, 96))]),
        node(
            "architect",
            ["pm"],
            _n(rng, 48),
            [Shared("sys:architect", 384), ContextOf("pm"), Unique(_n(rng, 16))],
        ),
    ]
    engs = []
    for i in range(engineers):
        engs.append(f"eng{i}")
        nodes.append(
            node(
                f"eng{i}",
                ["architect"],
                _n(rng, 48),
                [ContextOf("architect"), Shared("sys:engineer", 192), Unique(_n(rng, 16))],
            )
        )
    nodes.append(
        node(
            "review",
            engs,
            _n(rng, 32),
            [
                Shared("sys:reviewer", 384),
                OutputOf("architect"),
                *(OutputOf(e) for e in engs),
                Unique(_n(rng, 16)),
            ],
        )
    )
    return nodes


def small_mapreduce(rng: np.random.Generator, wid: str) -> list[Node]:
    """A planner reads the workflow's own document; 3-4 workers fork its conversation;
    a reducer joins their outputs."""
    k = int(rng.integers(3, 5))
    nodes = [
        node(
            "plan",
            [],
            _n(rng, 32),
            [Shared("sys:planner", 256), Unique(_n(rng, 768, 0.25)), Unique(_n(rng, 32))],
        )
    ]
    maps = []
    for i in range(k):
        maps.append(f"map{i}")
        nodes.append(
            node(f"map{i}", ["plan"], _n(rng, 48), [ContextOf("plan"), Unique(_n(rng, 16))])
        )
    nodes.append(
        node(
            "reduce",
            maps,
            _n(rng, 48),
            [Shared("sys:reducer", 192), *(OutputOf(m) for m in maps), Unique(_n(rng, 16))],
        )
    )
    return nodes


def small_debate(rng: np.random.Generator, wid: str) -> list[Node]:
    """3 agents over 2 rounds on the workflow's topic, each continuing its own context
    with the others' last turns; a judge reads the topic and every turn."""
    agents, rounds = 3, 2
    topic = f"topic:{wid}"
    topic_len = _n(rng, 512, 0.25)
    nodes: list[Node] = []
    prev: list[str] = []
    for r in range(rounds):
        cur = []
        for a in range(agents):
            nid = f"a{a}.r{r}"
            if r == 0:
                prompt: list[Segment] = [
                    Shared("sys:debater", 256),
                    Shared(topic, topic_len),
                    Unique(_n(rng, 32)),
                ]
            else:
                own = f"a{a}.r{r - 1}"
                prompt = [ContextOf(own), *(OutputOf(p) for p in prev if p != own)]
                prompt.append(Unique(_n(rng, 16)))
            nodes.append(node(nid, list(prev), _n(rng, 40), prompt))
            cur.append(nid)
        prev = cur
    everyone = [n.id for n in nodes]
    nodes.append(
        node(
            "judge",
            prev,
            _n(rng, 48),
            [
                Shared("sys:judge", 192),
                Shared(topic, topic_len),
                *(OutputOf(n) for n in everyone),
                Unique(_n(rng, 16)),
            ],
        )
    )
    return nodes


def small_apps() -> dict[str, AppBuilder]:
    return {"pipeline": small_pipeline, "mapreduce": small_mapreduce, "debate": small_debate}


def generate_small(
    app: str,
    workflows: int,
    rate: float,
    seed: int,
    profile: Profile,
    slack: float,
    hop_s: float,
) -> list[Workflow]:
    """Poisson arrivals at `rate` workflows/s; deadline = slack x (critical path alone
    + hop_s per node on it)."""
    builders = small_apps()
    if app not in builders:
        raise ValueError(f"unknown app {app!r}; choose from: {', '.join(builders)}")
    if workflows <= 0 or not rate > 0 or not slack > 0 or hop_s < 0:
        raise ValueError("workflows, rate and slack must be positive, hop_s not negative")
    rng = np.random.Generator(np.random.PCG64(seed))
    t = 0.0
    out = []
    for i in range(workflows):
        if i:
            t += float(rng.exponential(1.0 / rate))
        wid = f"{app}-s{seed}-{i}"
        nodes = builders[app](rng, wid)
        draft = Workflow.create(wid, app, t, 1.0, nodes)
        hops = draft.critical_path({n: 1.0 for n in draft.nodes})
        deadline = slack * (critical_path_alone_s(draft, profile) + hop_s * hops)
        out.append(Workflow.create(wid, app, round(t, 6), round(deadline, 3), nodes))
    return out


class TextReplayer(Replayer):
    """`wasma replay` sending each prompt as text (its token ids decoded), for routers
    that route on text. The engines re-tokenise it: about 15% more tokens with the tiny
    model's BPE, the same prefixes shared."""

    def __init__(self, *args: Any, tokenizer_file: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(tokenizer_file)

    def _payload(self, wf: Workflow, node_id: str, prompt: list[int]) -> dict[str, Any]:
        body = super()._payload(wf, node_id, prompt)
        body["prompt"] = self._tok.decode(prompt, skip_special_tokens=True)
        return body
