"""Requests as the engine takes them: wire lines in (types), validated and tokenized
(prepare), and the scheduler's view of them (jobs: a Job per request, a Seq per candidate)."""
