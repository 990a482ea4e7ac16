"""Generation engine. Importing this package imports torch: never from the API process.

Entry point: `batchwright.engine.engine.Engine` (`Engine.load(spec)`, `engine.run(requests)`).
Semantics and batching design: docs/engine.md.
"""
