"""The KV cache: blocks, the paged pools, the prefix index, and the KV manager that places
prompts in them and owns the bound on what a row may generate."""
