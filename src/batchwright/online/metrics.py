"""Online metrics of the API process (the default registry; summed over API processes in
prometheus-client's multiprocess mode). Preemptions are counted by the workers."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

REQUESTS = Counter(
    "batchwright_online_requests_total",
    "Online requests (/v1/completions and /v1/chat/completions) by model, how they ended "
    "(HTTP status) and streaming",
    ["model", "status", "stream"],
)
TIME_TO_FIRST_TOKEN = Histogram(
    "batchwright_online_time_to_first_token_seconds",
    "Seconds from a streamed request's arrival to its first chunk",
    ["model"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
INTER_TOKEN_LATENCY = Histogram(
    "batchwright_online_inter_token_latency_seconds",
    "Seconds between a stream's chunks, per generated token they carry",
    ["model"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
TOKENS = Counter(
    "batchwright_online_tokens_total",
    "Tokens of finished online requests by model and kind (prompt, completion)",
    ["model", "kind"],
)
DISCONNECTS = Counter(
    "batchwright_online_disconnects_total",
    "Online requests whose client left before the end (their rows are cancelled)",
    ["model"],
)
RATE_LIMITED = Counter(
    "batchwright_online_rate_limited_total",
    "Online requests refused by their project's rate limit, by the limit",
    ["limit"],
)
USAGE_DROPPED = Counter(
    "batchwright_online_usage_rows_dropped_total",
    "Usage rows dropped: the buffer was full (database away too long) or the row refused",
)
USAGE_WRITE_SECONDS = Histogram(
    "batchwright_online_usage_write_seconds", "Seconds per batched write of usage rows"
)
