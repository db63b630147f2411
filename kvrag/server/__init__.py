"""`kvrag serve`: the OpenAI-compatible HTTP server, cut the way vLLM's is: `app` wires the routes;
`protocol` holds the typed requests, responses and chunks; `serving_chat` and `serving_completion`
one endpoint each over `serving`; `auth`, `admission`, `worker` and `settings` one concern each;
`metrics` the Prometheus exposition."""

from kvrag.server.app import ServeSettings, app_from_environment, create_app

__all__ = ["ServeSettings", "create_app", "app_from_environment"]
