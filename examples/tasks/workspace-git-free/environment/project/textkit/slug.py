"""URL slugs for post titles."""
import re
import unicodedata


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
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = text.lower()
    text = re.sub(r"[^a-z0-9]", separator, text)
    text = text.strip("-")
    if max_length is not None:
        text = text[:max_length]
    return text


def unique_slug(text, existing, max_length=50, separator="-"):
    """Return ``slugify(text, max_length, separator)`` if it is not in ``existing``.

    Otherwise append ``separator`` and a number, trying 2, 3, 4, ... in turn, and
    return the first slug not in ``existing``. The whole result, suffix included,
    respects ``max_length``: the words before the suffix are shortened by the same
    rule as in ``slugify`` to make room for it.
    """
    base = slugify(text, max_length, separator)
    slug = base
    n = 1
    while slug in existing:
        slug = f"{base}{separator}{n}"
        n += 1
    return slug
