#!/bin/bash
# Oracle solution for workspace-git-free: rewrites the two buggy functions.
set -euo pipefail
cd /workspace/project

cat > textkit/slug.py <<'PY'
"""URL slugs for post titles."""
import re
import unicodedata


def _shorten(slug, max_length, separator):
    if max_length is None or len(slug) <= max_length:
        return slug
    out = ""
    for word in slug.split(separator):
        candidate = word if not out else out + separator + word
        if len(candidate) > max_length:
            break
        out = candidate
    return out or slug.split(separator)[0][:max_length]


def slugify(text, max_length=50, separator="-"):
    """Turn ``text`` into a URL slug.

    - Accented letters are reduced to ASCII (Unicode NFKD, then characters with no
      ASCII form are dropped): "Crème" -> "creme".
    - The result is lower case.
    - Apostrophes (' and ’) are removed without leaving a gap: "Don't" -> "dont".
    - Every run of one or more characters other than a-z and 0-9 becomes ONE
      ``separator``; the slug never starts or ends with ``separator``.
    - ``separator`` is a single character, one of "-", "_" or ".".
    - If ``max_length`` is not None and the slug is longer than ``max_length``, it
      is shortened to the longest run of whole leading words (joined by
      ``separator``) that fits; if not even the first word fits, the first word is
      cut to ``max_length`` characters.
    - Text with no letters or digits gives "".
    """
    text = text.replace("'", "").replace("\u2019", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = text.lower()
    text = re.sub(r"[^a-z0-9]+", separator, text).strip(separator)
    return _shorten(text, max_length, separator)


def unique_slug(text, existing, max_length=50, separator="-"):
    """Return ``slugify(text, max_length, separator)`` if it is not in ``existing``.

    Otherwise append ``separator`` and a number, trying 2, 3, 4, ... in turn, and
    return the first slug not in ``existing``. The whole result, suffix included,
    respects ``max_length``: the words before the suffix are shortened by the same
    rule as in ``slugify`` to make room for it.
    """
    slug = slugify(text, max_length, separator)
    n = 2
    while slug in existing:
        suffix = f"{separator}{n}"
        room = None if max_length is None else max_length - len(suffix)
        slug = slugify(text, room, separator) + suffix
        n += 1
    return slug
PY

python3 -c 'import sys; sys.path.insert(0, "."); from textkit import slugify, unique_slug; print(slugify("Hello, World!"), unique_slug("Hello World", {"hello-world"}))'
