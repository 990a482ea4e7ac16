"""Webhooks: per-project endpoints, an outbox written with each terminal batch status, and
signed deliveries (Standard Webhooks, as OpenAI sends them)."""
