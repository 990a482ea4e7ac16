"""The model runner: the device state of a loaded model (slots, sampler, graphs, KV
cache, compiled forward), which turns a plan into one forward and one sampling step."""
