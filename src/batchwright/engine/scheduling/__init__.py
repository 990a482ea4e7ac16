"""What runs next: the scheduler's plan of a step (no tensors), the intake of waiting
requests, the lane that puts online requests ahead of them (lane.py) and the preemption
of batch rows."""
