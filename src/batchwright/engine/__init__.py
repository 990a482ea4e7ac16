"""Generation engine. Importing this package imports torch: never from the API process.

Entry point: `batchwright.engine.runtime.Engine` (`Engine.load(spec)`, `engine.run(requests)`).
Semantics and batching design: docs/engine.md.
"""

from batchwright.engine.import_noise import quiet

quiet()
