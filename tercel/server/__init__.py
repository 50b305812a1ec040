"""Tercel's OpenAI-compatible HTTP server (FastAPI + uvicorn).

Run it with `tercel serve [MODEL]` or `python -m tercel.server [MODEL]`. `import tercel` never imports
this package; its web dependencies load only when the server starts (see cli.run_serve).
"""
