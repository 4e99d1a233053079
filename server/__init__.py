"""The OpenAI-compatible HTTP server.

NOTE: `engine` first: it sets OpenMP's wait policy before torch loads (engine/__init__.py).
"""

from ringserve import engine  # noqa: F401
