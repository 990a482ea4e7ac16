"""What runs next: the scheduler's plan of a step (no tensors), the intake of waiting
requests, the online lane ahead of them and the preemption of batch rows."""
