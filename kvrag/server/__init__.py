"""`kvrag serve`: the OpenAI-compatible HTTP server (`app`: routes, admission, workers), its wire
format (`openai_api`) and its Prometheus metrics (`metrics`)."""

from kvrag.server.app import ServeSettings, app_from_environment, create_app

__all__ = ["ServeSettings", "create_app", "app_from_environment"]
