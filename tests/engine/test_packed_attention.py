"""The embedding engine's native packed attention (platform/csrc/packed_attention.h)
against SDPA on each input's own tokens, in every build this CPU runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchwright.engine.platform import native
from tests.engine.test_paged import _RUNNABLE


def _sdpa_per_input(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], causal: bool
) -> torch.Tensor:
    want = torch.zeros_like(q)
    start = 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].transpose(0, 1)[None] for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
        )
        want[start : start + n] = out[0].transpose(0, 1)
        start += n
    return want


@pytest.mark.parametrize("isa", ["avx512", "avx2", "base"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "dim", "spread"),
    [
        (12, 12, 32, 1.0),  # the embedding bench's encoder: two AVX-512 registers a head
        (4, 4, 64, 2.0),  # a peaked softmax
        (4, 2, 48, 1.0),  # grouped heads; a dim of 3 AVX-512 registers (a 1-register tail)
        (2, 1, 8, 1.0),  # one AVX2 register a head
    ],
)
def test_packed_attention_matches_sdpa_per_input(
    isa: str, causal: bool, q_heads: int, kv_heads: int, dim: int, spread: float
) -> None:
    # Lengths around the kernel's 8-row blocks and 2-vector column chunks, one token, and
    # a long input; q, k and v strided views of one projection output, as the model gives.
    if native.module() is None:
        pytest.skip("no C++ toolchain to build the native kernels on this machine")
    if isa != "base" and isa not in _RUNNABLE:
        pytest.skip(f"this CPU does not run {isa}")
    module = native.load(isa)
    if dim % module.packed_attention_dims():
        pytest.skip(f"the {isa} build takes dims in multiples of {module.packed_attention_dims()}")
    gen = torch.Generator().manual_seed(5)
    lengths = [1, 7, 8, 9, 16, 31, 32, 33, 100, 300]
    tokens = sum(lengths)
    qkv = torch.randn(tokens, q_heads + 2 * kv_heads, dim, generator=gen) * spread
    q = qkv[:, :q_heads]
    k = qkv[:, q_heads : q_heads + kv_heads]
    v = qkv[:, q_heads + kv_heads :]
    starts = torch.tensor([sum(lengths[:i]) for i in range(len(lengths))])
    got = module.packed_attention(q, k, v, starts, torch.tensor(lengths), dim**-0.5, causal)
    want = _sdpa_per_input(q, k, v, lengths, causal)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_inputs_out_of_the_row_are_refused() -> None:
    if native.module() is None:
        pytest.skip("no C++ toolchain to build the native kernels on this machine")
    q = torch.randn(10, 2, 16)
    with pytest.raises(RuntimeError, match="outside the row"):
        native.module().packed_attention(
            q, q, q, torch.tensor([0, 6]), torch.tensor([6, 5]), 0.25, False
        )


def test_the_embedding_attention_takes_the_kernel_for_float32_on_cpu() -> None:
    # The engine's choice (engine/embed/attention.py): the kernel for the tiny test
    # models' float32 heads of 16 dims, SDPA for other dtypes and for rows the kernel
    # cannot read.
    if native.module() is None:
        pytest.skip("no C++ toolchain to build the native kernels on this machine")
    from batchwright.engine.embed.attention import Packed, _native

    plan = Packed(
        runs=[(0, 1, 4)],
        cu=None,
        max_len=4,
        varlen=False,
        starts=torch.tensor([0]),
        lengths=torch.tensor([4]),
    )
    qkv = torch.randn(4, 3, 2, 16)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    assert _native(q, k, v, plan) is not None
    assert _native(q.bfloat16(), k.bfloat16(), v.bfloat16(), plan) is None
    assert _native(q, k, torch.randn(4, 2, 32)[..., ::2], plan) is None
