"""OpenAI-compatible HTTP frontend (Starlette + uvicorn) over an AsyncEngine."""
