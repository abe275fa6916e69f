"""``sequester serve``: episodes and kernels over OpenEnv's protocol (HTTP + WebSocket).

:mod:`.protocol` (the frames and their models, pure), :mod:`.serve_settings` (``[serve]``),
:mod:`.auth` (the bearer token), :mod:`.sessions` (episode and kernel sessions, capacity),
:mod:`.connection` (one WebSocket connection), :mod:`.app` (the FastAPI app).

Nothing is imported here: :mod:`sequester.config` reads :mod:`.serve_settings` for every command,
and must not pull FastAPI in with it.
"""
