"""Generation engine. Its modules import torch (requests/types.py and requests/observer.py
do not): never from the API process.

Entry point: `batchwright.engine.engine.Engine`: `Engine.load(spec)` once per model,
`engine.run(requests)` over validated requests; wire lines are prepared for it (off its
thread) and the wire objects of its results built by `batchwright.serving`. Layers
(engine | embed > scheduling | runner | output > lora > loading > attention > kv >
requests > sampling | text > platform) are checked by import-linter. Semantics and
batching design: docs/engine.md.
"""

from batchwright.engine.platform import lazy_imports
from batchwright.engine.platform.import_noise import quiet

quiet()
lazy_imports.defer()
