"""The attention variants on the paged cache against attention written out per row: the
native kernel and the reference backend, with sliding windows that start inside a block,
soft-capping, sinks, value heads of another width and grouped queries."""

from __future__ import annotations

import pytest
import torch

from batchwright.engine.attention import backends
from batchwright.engine.attention.native import paged_attention_kernel
from batchwright.engine.attention.variants import Variant, attend, band

BS, HQ, HKV, DK, DV = 16, 4, 2, 16, 12


def _pools(blocks: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn((blocks, BS, HKV, DK), generator=g)
    v = torch.randn((blocks, BS, HKV, DV), generator=g)
    return k, v


def _written_out(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, scale: float, var: Variant
) -> torch.Tensor:
    """One row's query [HQ, DK] over its first n keys [n, HKV, D], all in float64."""
    keys = k[:n].double().repeat_interleave(HQ // HKV, 1).transpose(0, 1)  # [HQ, n, DK]
    values = v[:n].double().repeat_interleave(HQ // HKV, 1).transpose(0, 1)
    s = torch.einsum("hd,hnd->hn", q.double(), keys) * scale
    if var.softcap is not None:
        s = torch.tanh(s / var.softcap) * var.softcap
    if var.window is not None:
        s[:, : max(0, n - var.window)] = float("-inf")
    if var.sinks is not None:
        s = torch.cat([s, var.sinks.double()[:, None]], dim=1)
    p = torch.softmax(s, dim=1)[:, :n]
    return torch.einsum("hn,hnd->hd", p, values).float()


VARIANTS = [
    Variant(window=5),
    Variant(window=21, softcap=3.0),
    Variant(sinks=torch.tensor([0.5, -1.0, 2.0, 9.0])),
    Variant(window=7, softcap=2.0, sinks=torch.tensor([1.0, 0.0, -3.0, 4.0])),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend", ["native", "reference"])
def test_paged_decode_attention_variants(variant: Variant, backend: str) -> None:
    if backend == "native" and paged_attention_kernel() is None:
        pytest.skip("no C++ toolchain to build the native kernel on this machine")
    kpool, vpool = _pools()
    lens = [1, 4, 17, 33, 50, 0]  # 0: a dead slot
    table = torch.zeros((len(lens), 5), dtype=torch.int32)
    rows = [[3, 7, 1, 9], [2], [4, 11], [5, 6, 8], [10, 12, 13, 14]]
    for r, blocks in enumerate(rows):
        table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    q = torch.randn((len(lens), HQ, DK), generator=torch.Generator().manual_seed(1))
    scale = 0.3
    if backend == "native":
        out = backends.native(q, kpool, vpool, table, torch.tensor(lens), scale, variant)
    else:
        runs = [(i, i + 1, n) for i, n in enumerate(lens) if n]
        out = backends.reference(q, kpool, vpool, table, runs, lens, scale, True, variant)
    assert out.shape == (len(lens), HQ, DV)
    for r, n in enumerate(lens):
        if n == 0:
            continue
        blocks = table[r, : -(-n // BS)].long()
        k = kpool[blocks].flatten(0, 1)
        v = vpool[blocks].flatten(0, 1)
        want = _written_out(q[r], k, v, n, scale, variant)
        torch.testing.assert_close(out[r], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_prompt_attention_variants(variant: Variant) -> None:
    g = torch.Generator().manual_seed(2)
    n = 30
    q = torch.randn((1, HQ, n, DK), generator=g)
    k = torch.randn((1, HKV, n, DK), generator=g)
    v = torch.randn((1, HKV, n, DV), generator=g)
    got = attend(q, k, v, band(n, n, variant.window, q.device), 0.3, variant, True)
    for i in range(n):
        want = _written_out(
            q[0, :, i], k[0].transpose(0, 1), v[0].transpose(0, 1), i + 1, 0.3, variant
        )
        torch.testing.assert_close(got[0, :, i], want, rtol=1e-4, atol=1e-5)
