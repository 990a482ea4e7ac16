"""The worker, by the process each part runs in.

- `generation/`: the generation process, a Celery worker serving its models' queues: the
  engine hosts (one engine loop per model), the online pump, the `process` task's body.
- `lease_child/`: the lease child beside it: claims, lease renewals, cancels, result
  writes (run in threads of the generation process where there is no child).
- `service.py` (any Celery worker process's start and stop: heartbeat, metrics, engine
  hosts) and `supervisor.py` (the companion processes: control worker, sweeper).
- Shared by those processes: `stats.py` (the process's counters and its heartbeat
  thread), `metrics.py` (its Prometheus metrics), `adapters.py` (LoRA adapters).

What the services import of work and workers (dispatch, routing, heartbeat readers,
budgets) is the control plane, `batchwright.controlplane`, below both.
"""
