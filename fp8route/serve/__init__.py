"""An OpenAI-compatible HTTP server over AsyncLLM (FastAPI + uvicorn, the `serve` extra), and a
client that drives any OpenAI-compatible server with the load `fp8route bench serve` makes.

protocol: the request and response shapes (pydantic, as OpenAI's); errors: OpenAI's error body;
serving: a validated request through the engine to text; metrics: /metrics; app: the routes;
server: uvicorn, SIGTERM drain; http_bench: the HTTP load client (aiohttp only).
"""

INSTALL_HINT = "pip install 'fp8route[serve]'"
