"""Duration helpers. Implement both functions (see the task instructions)."""


def parse_duration(text):
    raise NotImplementedError


def format_duration(seconds):
    raise NotImplementedError
