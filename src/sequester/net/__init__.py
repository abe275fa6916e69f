"""The network allowlist: in-sandbox plan, host-side broker, in-sandbox bridge."""
