"""A tiny random-weight Llama model plus a byte-level BPE tokenizer, built offline.

Used for the `demo` model, for tests and for the CPU benchmark: nothing can be downloaded
here, so the real loading path (`from_pretrained`) is exercised on files we write ourselves.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from filelock import FileLock
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
# The demo's chat template (transformers reads chat_template.jinja beside the tokenizer):
# one "role: text" line per message, then "assistant:" for the reply to come.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TEMPLATE_FILE = "chat_template.jinja"

_CORPUS = """
The quick brown fox jumps over the lazy dog. A batch of requests arrives at the server,
and every line is a small piece of work: a prompt, a number of tokens, a temperature.
Once upon a time there was a little model that learned to write stories about the sea,
the mountains, the rivers and the people who lived in the small towns along the coast.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 and 2024 appear in many documents.
Questions: What is the capital of France? Paris is the capital of France. Why is the sky
blue? Because sunlight is scattered by the air. How many legs does a spider have? Eight.
Code: def add(a, b): return a + b; for i in range(10): print(i); if x > 0: y = x * 2.
The weather today is sunny with a light breeze, and tomorrow it may rain in the evening.
She said hello, he said goodbye, and they walked home together through the quiet park.
Machine learning models predict the next token given the previous tokens in a sequence.
Stop words, punctuation marks, commas, periods; colons: and "quotes" are all characters.
"""


def _corpus_lines() -> list[str]:
    lines = [ln.strip() for ln in _CORPUS.strip().splitlines() if ln.strip()]
    # Repeat with simple variations so that BPE has enough pair statistics for ~1000 merges.
    out: list[str] = []
    for i in range(20):
        for ln in lines:
            out.append(ln if i % 2 == 0 else ln.lower())
            out.append(ln.upper() if i % 5 == 0 else ln.replace(".", f" {i}."))
    return out


def build_tokenizer(vocab_size: int = 1000) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )


def build_demo_model(
    path: str | Path,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    vocab_size: int = 1000,
    max_position_embeddings: int = 512,
    seed: int = 0,
    intermediate_size: int | None = None,
    initializer_range: float = 0.2,
    model_vocab_size: int | None = None,
) -> Path:
    """Write a random LlamaForCausalLM + tokenizer in HF format under `path`; return it.

    `initializer_range` is larger than Llama's 0.02 so the random model has peaked
    next-token distributions: greedy decoding then has no near-ties that fp32 rounding
    could flip, which keeps the batched-versus-direct comparisons in the tests meaningful.
    The built-in corpus yields about 1,000 BPE tokens; `model_vocab_size` makes the output
    layer bigger than the tokenizer (ids past it decode to nothing), for benchmarks that
    need a realistic vocabulary-sized softmax. `kv_heads` below `heads` gives grouped-query
    attention.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    eos_id = int(tokenizer.convert_tokens_to_ids(EOS_TOKEN))  # type: ignore[arg-type]
    config = LlamaConfig(
        vocab_size=max(len(tokenizer), model_vocab_size or 0),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=initializer_range,
    )
    # A private generator keeps the build deterministic without touching global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / TEMPLATE_FILE).write_text(CHAT_TEMPLATE, encoding="utf-8")
    return out


def _add_template(out: Path) -> None:
    """A demo model built before chat lines existed gets its template: one new file,
    renamed into place, so a process loading the model meanwhile sees it whole or not."""
    tmp = out / f".{TEMPLATE_FILE}.{os.getpid()}"
    tmp.write_text(CHAT_TEMPLATE, encoding="utf-8")
    os.replace(tmp, out / TEMPLATE_FILE)


def ensure_demo_model(path: str | Path) -> Path:
    """Build the demo model at `path` unless it is there. Workers starting together take a
    file lock; each build goes to a private folder renamed into place, so no process ever
    loads a half-written model."""
    out = Path(path)
    if (out / "config.json").exists() and (out / TEMPLATE_FILE).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").exists():
            if not (out / TEMPLATE_FILE).exists():
                _add_template(out)
            return out  # another process built it while this one waited
        tmp = out.parent / f".{out.name}.build-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build_demo_model(tmp)
        if out.exists():  # a partial folder from an older, unlocked build
            shutil.rmtree(out)
        os.replace(tmp, out)
    return out
