"""The engine interface's small parts."""

from __future__ import annotations

import pickle
import subprocess
import sys

from wasma.engines.base import Deferred, EngineCall


def test_a_deferred_value_crosses_pickling_as_bytes_and_is_read_on_the_far_side() -> None:
    call = EngineCall("/v1/completions", b"{}", False, generate=Deferred({"n": 2}))
    assert call.generate is not None and call.generate.get() == {"n": 2}
    far = pickle.loads(pickle.dumps(call))
    assert far.generate is not None and far.generate.get() == {"n": 2}
    # Passed on again before it was read: the same bytes, still readable at the end.
    again = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(call))))
    assert again.generate.get() == {"n": 2}
    assert Deferred(None).get() is None


def test_unpickling_a_call_carrying_vllms_rendered_request_does_not_import_vllm() -> None:
    """The router (a Ray actor over simulators, say) unpickles every request: vLLM is
    imported only by the engine that reads the rendered request."""
    from vllm import SamplingParams
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    rendered = GenerateRequest(token_ids=[1, 2], sampling_params=SamplingParams())
    blob = pickle.dumps(EngineCall("/v1/completions", b"{}", False, generate=Deferred(rendered)))
    code = (
        "import pickle, sys; c = pickle.loads(sys.stdin.buffer.read()); "
        "print('vllm' in sys.modules); print(type(c.generate.get().sampling_params).__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=blob, capture_output=True, check=True
    ).stdout.decode()
    assert out.split() == ["False", "SamplingParams"]
