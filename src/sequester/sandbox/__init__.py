"""Sandbox construction: host facts, the mount plan, bwrap argv, and the launcher that orders them."""
