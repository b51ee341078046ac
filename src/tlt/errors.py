"""Project errors: one clear message naming the problem, never a stack trace from deep inside torch."""


class TltError(ValueError):
    """Base class of every error tlt raises on bad input."""


class ModelLoadError(TltError):
    """A model path, file or architecture that tlt cannot load."""


class RequestError(TltError):
    """A rollout request or sampling setting that cannot be served."""


def first_line(error: Exception, limit: int = 300) -> str:
    """The first line of an exception's message (or its type's name), at most `limit` characters: what a
    one-line error quotes."""
    lines = str(error).strip().splitlines()
    return lines[0][:limit] if lines else type(error).__name__
