"""RMSNorm and rotary as native passes on CPU (engine/loading/fused.py), and the linear
layers through oneDNN (engine/loading/onednn.py), against transformers' own code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers.models.llama.modeling_llama as llama
from transformers import AutoModelForCausalLM

from batchwright.engine.loading import fused, onednn
from batchwright.engine.loading.demo import build_demo_model
from batchwright.engine.platform import native

pytestmark = pytest.mark.skipif(native.module() is None, reason="no C++ compiler here")


def _rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + llama.rotate_half(q) * s, k * c + llama.rotate_half(k) * s


@torch.no_grad()
def test_the_engine_model_runs_the_native_passes_with_transformers_results(tmp_path: Path) -> None:
    path = build_demo_model(tmp_path / "m", hidden_size=128, heads=4, kv_heads=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 37))
    want = model(input_ids=ids, use_cache=False).logits
    norms, rotaries = fused.use_fused(model)
    assert norms == 2 * model.config.num_hidden_layers + 1
    # (The module's rotary is replaced once per process: an earlier engine may have done it.)
    assert rotaries <= 1 and getattr(llama.apply_rotary_pos_emb, "batchwright_fused", False)
    got = model(input_ids=ids, use_cache=False).logits
    # The rotary is exact; the RMSNorm's sum of squares rounds otherwise (2e-5 here, on
    # logits of a random model up to 5).
    assert torch.allclose(got, want, atol=1e-4)
    # A second model of the family finds the module's rotary done already.
    assert fused.use_fused(model) == (0, 0)


def test_rotary_is_bit_for_bit_transformers_and_rmsnorm_within_a_rounding() -> None:
    gen = torch.Generator().manual_seed(0)
    # Heads as views of one packed projection's columns, as the engine's models make them.
    packed = torch.randn(1, 53, 12 * 64, generator=gen)
    q = packed[..., : 8 * 64].view(1, 53, 8, 64).transpose(1, 2)
    k = packed[..., 8 * 64 : 10 * 64].view(1, 53, 2, 64).transpose(1, 2)
    cos, sin = torch.randn(1, 53, 64, generator=gen), torch.randn(1, 53, 64, generator=gen)
    kernel = native.module()
    assert kernel is not None
    got_q, got_k = kernel.rotary_embed(q, k, cos, sin)
    want_q, want_k = _rotary_reference(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.stride() == want_q.stride()  # laid out as ATen lays out q * cos
    norm = llama.LlamaRMSNorm(96, eps=1e-5)
    norm.weight.data.normal_(generator=gen)
    x = torch.randn(5, 7, 96, generator=gen)
    want = llama.LlamaRMSNorm.forward(norm, x)
    got = kernel.rms_norm(x, norm.weight.detach(), 1e-5)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_other_dtypes_keep_transformers_code() -> None:
    norm = llama.LlamaRMSNorm(64).to(torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(fused._rms_forward(norm, x), llama.LlamaRMSNorm.forward(norm, x))


@torch.no_grad()
def test_onednn_layers_give_a_row_the_same_bits_at_any_row_count() -> None:
    if not onednn.available():
        pytest.skip("torch built without oneDNN")
    layer = torch.nn.Linear(512, 96)
    reference = torch.nn.Linear(512, 96)
    reference.load_state_dict(layer.state_dict())
    assert onednn.use_onednn(torch.nn.Sequential(layer)) == 1
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(512, generator=gen)
    want = layer(row[None])[0]
    for m in (1, 3, 17, 64, 65, 130):
        x = torch.randn(m, 512, generator=gen)
        x[m // 2] = row
        out = layer(x)
        assert torch.equal(out[m // 2], want)
        assert torch.allclose(out, reference(x), atol=1e-4)


@torch.no_grad()
def test_an_encoders_blocks_through_onednn_give_the_eager_results() -> None:
    if not onednn.available():
        pytest.skip("torch built without oneDNN")
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=300,
        hidden_size=384,
        num_hidden_layers=2,
        num_attention_heads=6,
        intermediate_size=1536,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = BertModel(config).eval()
    ids = torch.randint(0, 300, (2, 29))
    want = model(input_ids=ids).last_hidden_state
    onednn.use_onednn(model)
    layer = model.encoder.layer[0]
    # The intermediate's GELU and both output blocks' residual sums run in the products.
    for block in (layer.intermediate, layer.attention.output, layer.output):
        assert "forward" in block.__dict__
    got = model(input_ids=ids).last_hidden_state
    # oneDNN's erf rounds otherwise (~1e-6 relative); the residual sums are the same bits.
    assert torch.allclose(got, want, atol=1e-5)
