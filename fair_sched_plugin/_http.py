"""HTTP client settings shared by everything that talks to an engine."""

from __future__ import annotations

# Idle pooled connections are dropped well before servers drop them: uvicorn (vLLM, SGLang's
# HTTP server, the emulator) closes an idle keep-alive connection after 5 s, httpx keeps one for
# 5 s by default, and a request sent on a connection the server is closing at that instant fails.
KEEPALIVE_EXPIRY_S = 2.0
