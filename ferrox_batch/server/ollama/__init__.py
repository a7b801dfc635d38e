"""Ollama's API (`/api/...`) over the same engine and admission as the OpenAI endpoints.

Each generation or embedding request is said as the chat, completion or embedding request it amounts to
(`translation`, `embedding_requests`, `options`, `names`), checked and submitted by `Preparer` like any
other, and its answer written back as Ollama's NDJSON lines or one object (`answers`, `wire`); a load
request is answered at once (`loading`). `models` answers what is served and
refuses model management; `errors` is Ollama's error shape; `routes` puts it all on an app.
"""
