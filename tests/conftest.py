"""Suite-wide settings."""

from __future__ import annotations

import os

# Importing LiteLLM (the plugin's tests do, in-process and in subprocesses) must never fetch its
# price list from the internet: tests talk to 127.0.0.1 only.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
