"""The lease child: a lease's database work, in a process beside the generation loop.

`python -m batchwright.worker.lease_child FD` (`serve`) claims lines (`claims`, shared
fairly by `fairshare`), renews the lease, closes the lines of cancelled batches
(`cancels`), reads claims ahead and writes results behind (`pipeline`, `results`). The
generation process talks to it over a socket (`messages`: every message either way).
Where there is no child (the embedded SQLite run, `lease_process` off), the generation
process runs the same parts in threads.
"""
