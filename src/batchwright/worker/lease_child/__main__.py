"""`python -m batchwright.worker.lease_child FD`: the lease child (serve.py)."""

from batchwright.worker.lease_child.serve import main

main()
