"""textkit: small text helpers used by the blog engine."""
from .slug import slugify, unique_slug

__all__ = ["slugify", "unique_slug"]
