"""Requests as the engine takes them: validated and tokenized (request: EngineRequest,
prepared from wire lines by batchwright/serving), the torch-free types that cross to the
worker (types), and the scheduler's view of them (jobs: a Job per request, a Seq per
candidate)."""
