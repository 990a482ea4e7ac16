"""Token ids as text: incremental detokenising, stop matching, token keys for logprobs."""
