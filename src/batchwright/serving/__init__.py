"""The engine served over OpenAI's wire: lines (wire bodies) in, OpenAI objects out.

The engine (batchwright.engine) takes validated requests and hands out finished jobs; this
layer, above it and below the worker, prepares lines for it (lines.py) and builds the
Completion and chat.completion objects of its results (completions.py, chat.py, wire.py).
"""
