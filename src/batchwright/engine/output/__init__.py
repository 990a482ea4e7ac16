"""The output processor: tokens recorded into candidates, stops and grammars advanced,
stream deltas, and the finished jobs the engine hands out."""
