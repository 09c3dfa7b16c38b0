"""An OpenAI-compatible HTTP server over AsyncLLM (FastAPI + uvicorn, the `serve` extra).

protocol: the request and response shapes (pydantic, as OpenAI's); errors: OpenAI's error body;
serving: a validated request through the engine to text; metrics: /metrics; app: the routes;
server: uvicorn, SIGTERM drain. The HTTP load client is fp8route.bench.http.
"""

INSTALL_HINT = "pip install 'fp8route[serve]'"
