"""Inputs of one forward packed into one row: no padding, equal lengths side by side.

`pack` orders the inputs it is given by length and lays them back to back; the attention
(attention.py) then runs one native call on CPU (one per run of equal lengths where the
kernel is missing), one varlen call on CUDA, and pooling (pooling.py) reads each input's
tokens by its offsets. What the host reads back is one [inputs, dim] tensor per forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchwright.engine.embed.attention import Packed


@dataclass(eq=False)
class Input:
    """One input of a request: its tokens, and how many of them lead with the prompt (not
    pooled where the model's Pooling says include_prompt false)."""

    owner: object  # the request (engine.py's job) it belongs to
    index: int  # its index among the request's inputs
    ids: list[int]
    prompt_tokens: int = 0


@dataclass(eq=False)
class Pack:
    inputs: list[Input]  # in row order (by length)
    ids: torch.Tensor  # [1, tokens]
    positions: torch.Tensor  # [1, tokens]
    plan: Packed
    starts: torch.Tensor  # [inputs] first token of each input in the row
    lengths: torch.Tensor  # [inputs]
    pool_from: torch.Tensor  # [inputs] first pooled token (after a prompt not pooled)
    tokens: int


def pack(
    inputs: list[Input],
    device: torch.device,
    *,
    position_offset: int = 0,
    varlen: bool = False,
    skip_prompt: bool = False,
) -> Pack:
    """`position_offset`: the first position id (RoBERTa-style models count from the
    padding index + 1). `skip_prompt`: pooling leaves out each input's prompt tokens."""
    ordered = sorted(inputs, key=lambda x: len(x.ids))
    ids: list[int] = []
    positions: list[int] = []
    runs: list[tuple[int, int, int]] = []
    starts: list[int] = []
    lengths: list[int] = []
    pool_from: list[int] = []
    for item in ordered:
        n = len(item.ids)
        start = len(ids)
        if runs and runs[-1][2] == n:
            s, count, _ = runs[-1]
            runs[-1] = (s, count + 1, n)
        else:
            runs.append((start, 1, n))
        starts.append(start)
        lengths.append(n)
        skip = min(item.prompt_tokens, n - 1) if skip_prompt else 0
        pool_from.append(start + skip)
        ids.extend(item.ids)
        positions.extend(range(position_offset, position_offset + n))
    cu = None
    if varlen:
        cu = torch.tensor([*starts, len(ids)], dtype=torch.int32).to(device, non_blocking=True)
    host = torch.tensor([ids, positions], dtype=torch.long)
    meta = torch.tensor([starts, lengths, pool_from], dtype=torch.long)
    if device.type == "cuda":
        host, meta = host.pin_memory(), meta.pin_memory()
    host = host.to(device, non_blocking=True)
    meta = meta.to(device, non_blocking=True)
    return Pack(
        inputs=ordered,
        ids=host[0:1],
        positions=host[1:2],
        plan=Packed(
            runs=runs,
            cu=cu,
            max_len=max(lengths),
            varlen=varlen,
            starts=torch.tensor(starts, dtype=torch.long),
            lengths=torch.tensor(lengths, dtype=torch.long),
        ),
        starts=meta[0],
        lengths=meta[1],
        pool_from=meta[2],
        tokens=len(ids),
    )
