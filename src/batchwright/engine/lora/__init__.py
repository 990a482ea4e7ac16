"""LoRA adapters in the base model's forward: one forward for rows of many adapters.

The base's matmuls run once for every row; each adapted linear layer then adds, per
token, its adapter's low-rank delta `B_s (A_s x) * scaling_s`, gathered by the token's
adapter slot (0: none). The pieces:

- `layers.py`: `LoraLinear`, wrapped around every linear layer of the decoder layers at
  load (the packed q/k/v and gate/up projections as one, their deltas side by side).
- `kernels.py`: how a step's deltas are computed: grouped (CPU: tokens gathered per
  adapter, two batched matmuls, cost in proportion to the adapter rows) or dense (CUDA,
  compiled or captured steps: every slot's product for every token, masked; static
  shapes, read from long-lived tensors only).
- `slots.py`: `max_loras` device slots holding adapters' weights, least recently used out.
- `store.py`: adapter weights read from PEFT folders off the loop, by name.
- `run.py`: what a scheduler run uses: admission gate (a row whose adapter has no slot
  waits), the per-step token index, the prefix cache's namespace per adapter.
"""
