"""Hardware/model profiles: engine limits and a step-time model for the simulator.

A step's time is linear in the work vLLM batches into it:

    step_s = base + per_prefill_token * P + per_decode_seq * D
             + per_decode_ctx_token * sum(decode contexts)
             + per_prefill_attn * sum(chunk_len * context_len)

which is the shape of the fitted models in the literature (Vidur, inference-sim) with a
quadratic prefill-attention term. Each profile file cites where its numbers come from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any, TypeGuard

import yaml


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file and field."""


@dataclass(frozen=True, slots=True)
class StepModel:
    base_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_decode_ctx_token_s: float
    per_prefill_attn_s: float  # per (chunk token x context token)

    def step_s(
        self, prefill_tokens: int, decode_seqs: int, decode_ctx: int, prefill_attn: int
    ) -> float:
        return (
            self.base_s
            + self.per_prefill_token_s * prefill_tokens
            + self.per_decode_seq_s * decode_seqs
            + self.per_decode_ctx_token_s * decode_ctx
            + self.per_prefill_attn_s * prefill_attn
        )


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    block_size: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    kv_bytes_per_token: int
    step: StepModel
    long_prefill_token_threshold: int = 0
    vocab_size: int = 128_256
    sources: tuple[str, ...] = ()
    # How much slower an engine's steps run for each other busy engine on the same host
    # (engines whose compute is the host's shared CPU cores, not a GPU of their own):
    # 0.5 = 1.5x the step time beside one busy neighbour. The simulator runs every
    # engine on its own device; the policy prices it for engines that share a host.
    host_contention: float = 0.0
    # A CPU KV tier below the GPU pool (vLLM's `--kv-offloading-size`; engines/sim/
    # cpu_tier.py): its size in GPU-sized blocks (0 = none), the PCIe bandwidth each way
    # and the fixed cost of one load (the connector's round trip through the scheduler).
    cpu_kv_blocks: int = 0
    cpu_h2d_bytes_per_s: float = 40e9
    cpu_d2h_bytes_per_s: float = 40e9
    cpu_load_latency_s: float = 0.0005

    def cpu_load_s(self, num_blocks: int) -> float:
        """Time to load `num_blocks` blocks from the CPU tier into GPU memory."""
        nbytes = num_blocks * self.block_size * self.kv_bytes_per_token
        return self.cpu_load_latency_s + nbytes / self.cpu_h2d_bytes_per_s

    def prefill_s(self, tokens: int, cached: int = 0) -> float:
        """Time to prefill `tokens` (of which `cached` are already in KV) alone."""
        left, done, total = tokens - cached, cached, 0.0
        while left > 0:
            chunk = min(left, self.max_num_batched_tokens)
            total += self.step.step_s(chunk, 0, 0, chunk * (done + chunk))
            done += chunk
            left -= chunk
        return total

    def decode_s(self, context: int, output_tokens: int, batch: int = 1) -> float:
        """Time to decode `output_tokens` for one request in a batch of `batch`."""
        ctx = context * batch
        n = output_tokens
        return n * self.step.step_s(0, batch, ctx, 0) + self.step.per_decode_ctx_token_s * (
            batch * n * (n - 1) / 2
        )

    def request_alone_s(self, prompt_tokens: int, output_tokens: int, cached: int = 0) -> float:
        """A request's latency on an idle engine (prefill produces the first token)."""
        return self.prefill_s(prompt_tokens, cached) + self.decode_s(
            prompt_tokens + 1, max(output_tokens - 1, 0)
        )


_INT_FIELDS = (
    "block_size",
    "num_kv_blocks",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "kv_bytes_per_token",
)


_CPU_FLOATS = ("cpu_h2d_bytes_per_s", "cpu_d2h_bytes_per_s", "cpu_load_latency_s")


def profile_from_dict(data: Any, where: str) -> Profile:
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: a profile must be a mapping")
    for key in ("name", *_INT_FIELDS, "step"):
        if key not in data:
            raise ProfileError(f"{where}: missing field {key!r}")
    ints: dict[str, int] = {}
    for key in (*_INT_FIELDS, "long_prefill_token_threshold", "vocab_size", "cpu_kv_blocks"):
        if key not in data:
            continue
        val = data[key]
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise ProfileError(f"{where}: {key} must be a non-negative integer, got {val!r}")
        ints[key] = val
    for key in _INT_FIELDS:
        if ints[key] == 0:
            raise ProfileError(f"{where}: {key} must be positive")
    known = {
        "name",
        "step",
        "sources",
        "long_prefill_token_threshold",
        "vocab_size",
        "host_contention",
        "cpu_kv_blocks",
        *_CPU_FLOATS,
        *_INT_FIELDS,
    }
    if set(data) - known:
        raise ProfileError(f"{where}: unknown field(s) {sorted(set(data) - known, key=str)}")
    if (ints["num_kv_blocks"] - 1) * ints["block_size"] < ints["max_model_len"]:
        raise ProfileError(
            f"{where}: max_model_len {ints['max_model_len']} exceeds the KV pool "
            f"({ints['num_kv_blocks'] - 1} usable blocks of {ints['block_size']} tokens)"
        )
    step = data["step"]
    if not isinstance(step, dict):
        raise ProfileError(f"{where}: step must be a mapping of coefficients")
    names = [f.name for f in fields(StepModel)]
    unknown = set(step) - set(names)
    if unknown:
        raise ProfileError(f"{where}: unknown step coefficient(s) {sorted(unknown, key=str)}")
    coeffs: dict[str, float] = {}
    for key in names:
        val = step.get(key)
        if not _finite_number(val) or val < 0:
            raise ProfileError(f"{where}: step.{key} must be a finite number >= 0, got {val!r}")
        coeffs[key] = float(val)
    if coeffs["base_s"] <= 0:
        raise ProfileError(f"{where}: step.base_s must be > 0 (a step is never free)")
    sources = data.get("sources", [])
    if not isinstance(sources, list):
        raise ProfileError(f"{where}: sources must be a list of strings")
    contention = data.get("host_contention", 0.0)
    if not _finite_number(contention) or not 0 <= contention <= 16:
        raise ProfileError(
            f"{where}: host_contention must be a number in [0, 16], got {contention!r}"
        )
    cpu: dict[str, float] = {}
    for key in _CPU_FLOATS:
        if key in data:
            val = data[key]
            if not _finite_number(val) or val < 0 or (key != "cpu_load_latency_s" and val == 0):
                raise ProfileError(f"{where}: {key} must be a finite number > 0, got {val!r}")
            cpu[key] = float(val)
    return Profile(
        name=str(data["name"]),
        step=StepModel(**coeffs),
        sources=tuple(str(s) for s in sources),
        host_contention=float(contention),
        **cpu,  # type: ignore[arg-type]
        **ints,
    )


def _finite_number(value: Any) -> TypeGuard[int | float]:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def builtin_profiles() -> list[str]:
    root = resources.files("wasma.core") / "profiles"
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str) -> Profile:
    """A built-in profile by name (`llama3-8b-h100`, `tiny-cpu`) or a YAML file."""
    root = resources.files("wasma.core") / "profiles"
    builtin = root / f"{name_or_path}.yaml"
    if builtin.is_file():
        text, where = builtin.read_text(), f"profile {name_or_path}"
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ProfileError(
                f"unknown profile {name_or_path!r}: not a built-in "
                f"({', '.join(builtin_profiles())}) and no such file"
            )
        try:
            text, where = path.read_text(), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ProfileError(f"{path}: cannot read profile: {reason or exc}") from None
    try:
        data = yaml.safe_load(text)
    except ValueError as exc:  # a YAML integer too long to read
        raise ProfileError(f"{where}: invalid YAML: {str(exc).splitlines()[0]}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ProfileError(f"{where}: invalid YAML{at}: {problem}") from exc
    return profile_from_dict(data, where)
