"""The OpenAI-compatible HTTP server (``dovetail serve``): FastAPI over one asynchronous engine loop.

:func:`dovetail.server.app.build_app` builds the application;
:func:`dovetail.server.launcher.serve` runs it with uvicorn.
"""
