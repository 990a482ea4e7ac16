"""`batchwright run`: resumable embedded runs, their progress and their report."""
