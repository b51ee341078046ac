"""Project errors: one clear message naming the problem, never a stack trace from deep inside torch."""


class TltError(ValueError):
    """Base class of every error tlt raises on bad input."""


class ModelLoadError(TltError):
    """A model path, file or architecture that tlt cannot load."""


class RequestError(TltError):
    """A rollout request or sampling setting that cannot be served."""


class NonFiniteError(TltError):
    """A model produced NaN or infinite values: no sample can be drawn from them."""


def first_line(error: Exception, limit: int = 300) -> str:
    """The first line of an exception's message (or its type's name), at most `limit` characters: what a
    one-line error quotes."""
    lines = [line.strip() for line in str(error).strip().splitlines()]
    if not lines:
        return type(error).__name__
    # a first line ending in ":" ("... from one of:") announces the lines that follow: cut there, it says nothing
    text = " ".join(line for line in lines if line) if lines[0].endswith(":") else lines[0]
    return text if len(text) <= limit else text[:limit - 1] + "…"
