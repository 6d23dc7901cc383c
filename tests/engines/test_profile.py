"""Profiles: validation, built-ins and the step-time model (core/profile.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from wasma.core.profile import (
    Profile,
    ProfileError,
    StepModel,
    builtin_profiles,
    load_profile,
    profile_from_dict,
)

BUILTIN = "llama3-8b-h100"


def raw() -> dict[str, Any]:
    return {
        "name": "t",
        "block_size": 4,
        "num_kv_blocks": 100,
        "max_num_batched_tokens": 8,
        "max_num_seqs": 4,
        "max_model_len": 64,
        "kv_bytes_per_token": 10,
        "step": {
            "base_s": 1.0,
            "per_prefill_token_s": 0.1,
            "per_decode_seq_s": 0.01,
            "per_decode_ctx_token_s": 0.001,
            "per_prefill_attn_s": 0.0001,
        },
        "sources": ["a test"],
    }


def test_builtin_profile_loads_and_cites_sources() -> None:
    assert BUILTIN in builtin_profiles()
    p = load_profile(BUILTIN)
    assert p.name == BUILTIN
    assert p.block_size == 16 and p.max_num_batched_tokens == 8192
    assert p.sources, "a profile must cite where its numbers come from"
    assert p.max_model_len <= (p.num_kv_blocks - 1) * p.block_size  # one request always fits


@pytest.mark.parametrize("name", builtin_profiles())
def test_every_builtin_profile_is_valid(name: str) -> None:
    p = load_profile(name)
    assert p.step.base_s > 0 and p.sources
    assert p.max_model_len <= (p.num_kv_blocks - 1) * p.block_size


def test_step_model_is_linear() -> None:
    s = StepModel(1.0, 0.1, 0.01, 0.001, 0.0001)
    assert s.step_s(0, 0, 0, 0) == 1.0
    assert s.step_s(10, 2, 100, 1000) == pytest.approx(1.0 + 1.0 + 0.02 + 0.1 + 0.1)


def test_prefill_s_chunks_by_token_budget() -> None:
    p = profile_from_dict(raw(), "t")
    # 20 tokens, budget 8: chunks 8, 8, 4 with attention chunk * (done + chunk)
    want = (
        p.step.step_s(8, 0, 0, 8 * 8)
        + p.step.step_s(8, 0, 0, 8 * 16)
        + p.step.step_s(4, 0, 0, 4 * 20)
    )
    assert p.prefill_s(20) == pytest.approx(want)
    assert p.prefill_s(20, cached=12) == pytest.approx(p.step.step_s(8, 0, 0, 8 * 20))
    assert p.prefill_s(0) == 0.0


def test_decode_and_request_alone() -> None:
    p = profile_from_dict(raw(), "t")
    # 3 decode steps at context 10, 11, 12 (batch 1)
    want = sum(p.step.step_s(0, 1, c, 0) for c in (10, 11, 12))
    assert p.decode_s(10, 3) == pytest.approx(want)
    assert p.request_alone_s(20, 1) == pytest.approx(p.prefill_s(20))
    assert p.request_alone_s(20, 4) == pytest.approx(p.prefill_s(20) + p.decode_s(21, 3))


def test_yaml_file_round_trip(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump(raw()))
    p = load_profile(str(f))
    assert isinstance(p, Profile) and p.name == "t" and p.sources == ("a test",)
    assert p.vocab_size > 0 and p.long_prefill_token_threshold == 0
    assert p.host_contention == 0.0  # a device of its own unless measured otherwise
    f.write_text(yaml.safe_dump({**raw(), "host_contention": 0.8}))
    assert load_profile(str(f)).host_contention == 0.8


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda d: d.pop("block_size"), "missing field 'block_size'"),
        (lambda d: d.pop("step"), "missing field 'step'"),
        (lambda d: d.update(block_size=0), "block_size must be positive"),
        (lambda d: d.update(num_kv_blocks=-5), "num_kv_blocks must be a non-negative integer"),
        (lambda d: d.update(max_num_seqs=2.5), "max_num_seqs"),
        (lambda d: d.update(max_model_len=True), "max_model_len"),
        (lambda d: d.update(vocab_size="big"), "vocab_size"),
        (lambda d: d.update(step=[1, 2]), "step must be a mapping"),
        (lambda d: d["step"].update(bogus=1.0), r"unknown step coefficient.*bogus"),
        (lambda d: d["step"].pop("per_decode_seq_s"), r"step\.per_decode_seq_s"),
        (lambda d: d["step"].update(per_prefill_token_s=-1.0), r"step\.per_prefill_token_s"),
        (lambda d: d["step"].update(base_s=0.0), r"step\.base_s must be > 0"),
        (lambda d: d.update(sources="x"), "sources must be a list"),
        (
            lambda d: d.update(host_contention=-0.1),
            r"host_contention must be a number in \[0, 16\]",
        ),
        (lambda d: d.update(host_contention="lots"), "host_contention"),
        # YAML and JSON integers no float holds: an error naming the field, no traceback.
        (lambda d: d["step"].update(base_s=10**400), r"step\.base_s must be a finite number"),
        (lambda d: d.update(host_contention=10**400), "host_contention must be a number"),
        (lambda d: d.update({1: "a", "foo": "b"}), r"unknown field\(s\) \[1, 'foo'\]"),
        (lambda d: d["step"].update({2: 1.0, "x": 1.0}), r"unknown step coefficient\(s\)"),
    ],
)
def test_bad_profile_fields_name_file_and_field(mutate: Any, pattern: str) -> None:
    d = copy.deepcopy(raw())
    mutate(d)
    with pytest.raises(ProfileError, match=r"^where\.yaml: .*" + pattern):
        profile_from_dict(d, "where.yaml")


def test_not_a_mapping() -> None:
    with pytest.raises(ProfileError, match="mapping"):
        profile_from_dict([1], "x")


def test_unknown_profile_name_lists_builtins() -> None:
    with pytest.raises(ProfileError, match=rf"unknown profile 'nope'.*{BUILTIN}"):
        load_profile("nope")


def test_bad_yaml_is_a_profile_error(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("name: x\nblock_size: [1,\n")
    with pytest.raises(ProfileError, match=r"bad\.yaml: invalid YAML"):
        load_profile(str(f))


def test_bad_yaml_error_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("name: x\nblock_size: [1,\n")
    with pytest.raises(ProfileError) as ei:
        load_profile(str(f))
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_coefficients_rejected(value: float) -> None:
    d = raw()
    d["step"]["per_prefill_token_s"] = value
    with pytest.raises(ProfileError, match="per_prefill_token_s"):
        profile_from_dict(d, "x")


def test_kv_pool_must_hold_one_max_len_request() -> None:
    d = raw()
    d["num_kv_blocks"] = 10  # 9 usable blocks x 4 = 36 tokens < max_model_len 64
    with pytest.raises(ProfileError, match="max_model_len"):
        profile_from_dict(d, "x")


def test_unknown_profile_key_rejected() -> None:
    d = raw()
    d["long_prefill_threshold"] = 5  # misspelt long_prefill_token_threshold
    with pytest.raises(ProfileError, match="long_prefill_threshold"):
        profile_from_dict(d, "x")


def test_a_profile_file_that_is_not_text_is_a_profile_error(tmp_path: Path) -> None:
    f = tmp_path / "bin.yaml"
    f.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(ProfileError, match=r"bin\.yaml: cannot read profile: not UTF-8 text"):
        load_profile(str(f))
