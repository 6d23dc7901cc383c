"""Workload generators for three representative multi-agent applications.

Each generator returns workflows with Poisson arrivals and deadlines of `slack` x the
workflow's critical path when run alone on one engine of the profile. Everything is
drawn from one seeded generator, so a seed gives the same trace on every machine.

- pipeline: a software team (product manager -> architect -> engineers -> reviewer, then
  review rounds where engineers revise and the reviewer checks again); long fixed role
  prompts; engineers continue the architect's conversation, revisions their own.
- mapreduce: a planner reads the workflow's long document and splits the work; K workers
  fork the planner's conversation (document + plan) with their part; a reducer joins
  their outputs.
- debate: N agents over R rounds on the workflow's topic; in each round every agent
  continues its own context with the previous round's transcript; a judge reads the
  whole transcript and closes.

Sizes follow agentic traffic: long inputs, short outputs (tens to a few hundred tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from wasma.core.profile import Profile
from wasma.scheduler.workflow import ContextOf, Node, OutputOf, Segment, Shared, Unique, Workflow


@dataclass(frozen=True, slots=True)
class AppSpec:
    name: str
    build: Callable[[np.random.Generator, str], list[Node]]
    slack: float


def sized(rng: np.random.Generator, mean: int, spread: float = 0.5) -> int:
    """A size around `mean` (uniform within +-spread), at least 1."""
    return max(1, int(rng.uniform(mean * (1 - spread), mean * (1 + spread))))


def node(nid: str, parents: list[str], out: int, prompt: Sequence[Segment]) -> Node:
    return Node(nid, tuple(parents), out, tuple(prompt))


def build_pipeline(rng: np.random.Generator, wid: str) -> list[Node]:
    engineers = int(rng.integers(2, 4))
    rounds = int(rng.integers(1, 3))
    nodes = [
        node("pm", [], sized(rng, 300), [Shared("sys:pm", 1500), Unique(sized(rng, 600))]),
        node(
            "architect",
            ["pm"],
            sized(rng, 400),
            [Shared("sys:architect", 1500), ContextOf("pm"), Unique(sized(rng, 40))],
        ),
    ]
    engs = []
    for i in range(engineers):
        nid = f"eng{i}"
        engs.append(nid)
        # Engineers continue the architect's conversation with their own assignment.
        nodes.append(
            node(
                nid,
                ["architect"],
                sized(rng, 350),
                [ContextOf("architect"), Shared("sys:engineer", 800), Unique(sized(rng, 40))],
            )
        )
    review = "review0"
    nodes.append(
        node(
            review,
            engs,
            sized(rng, 200),
            [
                Shared("sys:reviewer", 1500),
                OutputOf("architect"),
                *(OutputOf(e) for e in engs),
                Unique(sized(rng, 30)),
            ],
        )
    )
    last = {e: e for e in engs}
    for r in range(1, rounds + 1):
        revs = []
        for e in engs:
            nid = f"{e}.r{r}"
            nodes.append(
                node(
                    nid,
                    [review],
                    sized(rng, 250),
                    [ContextOf(last[e]), OutputOf(review), Unique(sized(rng, 20))],
                )
            )
            last[e] = nid
            revs.append(nid)
        nxt = f"review{r}"
        nodes.append(
            node(
                nxt,
                revs,
                sized(rng, 150),
                [ContextOf(review), *(OutputOf(v) for v in revs), Unique(sized(rng, 20))],
            )
        )
        review = nxt
    return nodes


def build_mapreduce(rng: np.random.Generator, wid: str) -> list[Node]:
    k = int(rng.integers(4, 9))
    nodes = [
        node(
            "plan",
            [],
            sized(rng, 120),
            # The user's document is the workflow's own: shared by its nodes only.
            [Shared("sys:planner", 800), Unique(sized(rng, 6000, 0.4)), Unique(sized(rng, 100))],
        )
    ]
    maps = []
    for i in range(k):
        nid = f"map{i}"
        maps.append(nid)
        # Workers fork the planner's conversation (document + plan) with their part.
        nodes.append(
            node(nid, ["plan"], sized(rng, 150), [ContextOf("plan"), Unique(sized(rng, 40))])
        )
    nodes.append(
        node(
            "reduce",
            maps,
            sized(rng, 250),
            [Shared("sys:reducer", 500), *(OutputOf(m) for m in maps), Unique(sized(rng, 40))],
        )
    )
    return nodes


def build_debate(rng: np.random.Generator, wid: str) -> list[Node]:
    agents = int(rng.integers(3, 5))
    rounds = int(rng.integers(2, 4))
    topic = f"topic:{wid}"
    topic_len = sized(rng, 3000, 0.4)
    nodes: list[Node] = []
    prev: list[str] = []
    for r in range(rounds):
        cur = []
        for a in range(agents):
            nid = f"a{a}.r{r}"
            if r == 0:
                prompt: list[Segment] = [
                    Shared("sys:debater", 800),
                    Shared(topic, topic_len),
                    Unique(sized(rng, 60)),
                ]
            else:
                own = f"a{a}.r{r - 1}"
                prompt = [ContextOf(own)]
                prompt += [OutputOf(p) for p in prev if p != own]
                prompt.append(Unique(sized(rng, 20)))
            nodes.append(node(nid, list(prev), sized(rng, 150), prompt))
            cur.append(nid)
        prev = cur
    everyone = [n.id for n in nodes]
    nodes.append(
        node(
            "judge",
            prev,
            sized(rng, 200),
            [
                Shared("sys:judge", 600),
                Shared(topic, topic_len),
                *(OutputOf(n) for n in everyone),
                Unique(sized(rng, 30)),
            ],
        )
    )
    return nodes


def app_specs() -> dict[str, AppSpec]:
    return {
        "pipeline": AppSpec("pipeline", build_pipeline, slack=2.0),
        "mapreduce": AppSpec("mapreduce", build_mapreduce, slack=2.0),
        "debate": AppSpec("debate", build_debate, slack=2.0),
    }


def critical_path_alone_s(wf: Workflow, profile: Profile) -> float:
    """The workflow's critical path with each node run alone on an idle engine."""
    cost = {
        n: profile.request_alone_s(wf.prompt_tokens(n), wf.nodes[n].output_tokens) for n in wf.nodes
    }
    return wf.critical_path(cost)


def scale_tokens(nodes: list[Node], factor: float) -> list[Node]:
    """The same DAG with every token count scaled (for small models on small machines)."""
    if factor == 1.0:
        return nodes

    def seg(s: Segment) -> Segment:
        if isinstance(s, Shared):
            return Shared(s.key, max(1, round(s.tokens * factor)))
        if isinstance(s, Unique):
            return Unique(max(1, round(s.tokens * factor)))
        return s

    return [
        Node(n.id, n.parents, max(1, round(n.output_tokens * factor)), tuple(map(seg, n.prompt)))
        for n in nodes
    ]


def generate(
    app: str,
    workflows: int,
    rate: float,
    seed: int,
    profile: Profile,
    slack: float | None = None,
    token_scale: float = 1.0,
) -> list[Workflow]:
    return list(iter_generate(app, workflows, rate, seed, profile, slack, token_scale))


def iter_generate(
    app: str,
    workflows: int,
    rate: float,
    seed: int,
    profile: Profile,
    slack: float | None = None,
    token_scale: float = 1.0,
) -> Iterator[Workflow]:
    """`generate`'s workflows one at a time, in arrival order (the same ones): a replay
    that reads them as they arrive holds only the live ones (100,000 mapreduce
    workflows are ~1 GiB as a list)."""
    specs = app_specs()
    if app not in specs:
        raise ValueError(f"unknown app {app!r}; choose from: {', '.join(specs)}")
    if workflows <= 0:
        raise ValueError("--workflows must be positive")
    if not rate > 0:
        raise ValueError("--rate must be positive (workflows per second)")
    spec = specs[app]
    factor = spec.slack if slack is None else slack
    if not factor > 0:
        raise ValueError("--slack must be positive")
    if not 0 < token_scale <= 100:
        raise ValueError("--token-scale must be in (0, 100]")
    return _draw(app, spec, workflows, rate, seed, profile, factor, token_scale)


def _draw(
    app: str,
    spec: AppSpec,
    workflows: int,
    rate: float,
    seed: int,
    profile: Profile,
    factor: float,
    token_scale: float,
) -> Iterator[Workflow]:
    rng = np.random.Generator(np.random.PCG64(seed))
    t = 0.0
    for i in range(workflows):
        t += float(rng.exponential(1.0 / rate))
        wid = f"{app}-{seed}-{i}"
        nodes = scale_tokens(spec.build(rng, wid), token_scale)
        draft = Workflow.create(wid, app, t, 1.0, nodes)
        # Rounded for a readable trace, but never to 0 (a deadline must be positive).
        deadline = max(round(factor * critical_path_alone_s(draft, profile), 3), 0.001)
        yield Workflow.create(wid, app, round(t, 6), deadline, nodes)
