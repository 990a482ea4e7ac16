"""The control plane: what the services and the workers share about work and workers.

How work is announced (`dispatch`: messages by name after commit; `celery_app`: the
broker's application, importable without torch), which queues a worker serves and how
many to wake (`routing`), which workers are live and what they serve (`heartbeats`, the
rows workers write), a line's two budgets (`budget`) and the signal that a batch started
(`newcomers`). Below the services (which import it) and the worker (which runs against
it); it knows neither, nor the engine.
"""
