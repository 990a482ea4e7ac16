"""Online `POST /v1/completions`: admission (key, body, validation, limits, live workers),
the relay to a worker of the model, the answer (a Completion, or SSE chunks), and the
accounting (a usage row per request, metrics). Holds no torch."""
