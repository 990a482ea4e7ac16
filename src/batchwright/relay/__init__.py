"""The relay: online requests from the API to a worker of their model, and their events
back, through Redis (the broker every deployment already runs).

Torch-free and below the API and the worker: both import it, it imports neither. The API
side (`api_side.ApiRelay`, asyncio) submits a request, reads its events and cancels it;
the worker side (`worker_side.WorkerRelay`, blocking) announces the worker, takes
requests, publishes events and reaps the requests of workers that died. Key layout:
`keys.RelayKeys`; message shapes: `messages`.
"""
