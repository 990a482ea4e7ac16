"""A small web dashboard served by the API: server-rendered pages behind the API keys."""
