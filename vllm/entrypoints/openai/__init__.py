"""The OpenAI-compatible server (``vllm serve``): api_server.py (app, routes, ``main``),
protocol.py (request and response bodies), serving_*.py (one handler per endpoint family)."""
