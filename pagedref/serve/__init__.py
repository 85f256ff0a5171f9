"""`pagedref.serve`: an OpenAI-compatible HTTP server on the engine (`python -m pagedref.serve`).

One idea per module: `engine_core` (the engine in a process of its own, stepping in a busy loop; one
message per step carries every request's new tokens), `async_engine` (the server's side of it: requests
join and leave between steps, each streams through a queue of its own), `protocol` (OpenAI's request fields, checked, and its
error shape), `api` (the FastAPI app: completions and chat completions, streamed as server-sent events,
/v1/models, /health, /metrics), `chat` (the model's chat template, rendered as transformers does),
`metrics` (Prometheus), `server` (uvicorn with a graceful shutdown). The docs page "Serving over HTTP"
(docs/serving.md) shows it from the outside.

Needs the `serve` extra: `pip install -e ".[serve]"` (FastAPI, uvicorn, prometheus_client, jinja2).
"""
