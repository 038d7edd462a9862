"""The HTTP server: OpenAI-compatible and SGLang-native routes over the engine's front.

server.py runs the process (uvicorn, startup, shutdown); app.py the routes; openai_serving.py
and native.py the request logic; bridge.py the hop from the front's thread into asyncio;
sse.py streaming; lifecycle.py drain and health; metrics.py Prometheus; auth.py the API key.
"""
