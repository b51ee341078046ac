"""Output files and directories: whole-file writes, and paths checked before the long work that writes them."""

from __future__ import annotations

import os
import tempfile
import zlib
from pathlib import Path

from tlt.errors import TltError


def is_utf8_text(text: str) -> bool:
    """Whether `text` can be written as UTF-8: a command line's undecodable bytes reach Python as lone
    surrogates, which fail later, far from where they were given (a tokenizer's TypeError, a save's JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def write_whole(path: Path, write) -> None:
    """write(temporary path), then rename it onto `path`: a save killed midway (a warm-up going on in place,
    --init DIR --out DIR) leaves the previous file whole, never one cut short."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        write(partial)
        share_as_umask(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def share_as_umask(*paths: Path) -> None:
    """Give files (and every file under a directory) the mode a plain open() would: safetensors >= 0.8 writes
    through a temporary file that is always 0600 (safetensors issue #782), which hid a trained policy or drafter
    from a serving container or a colleague while its config.json beside it was readable."""
    mode = 0o666 & ~_umask()
    for path in paths:
        path = Path(path)
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        for file in files:
            os.chmod(file, mode)


def _umask() -> int:
    try:  # Linux reports it; setting it to read it would, for an instant, change it for every thread
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0)  # elsewhere the only way: set, then restore at once
    os.umask(mask)
    return mask


def refuse_a_file_in_the_way(directory: Path, option: str, error: type[TltError] = TltError) -> None:
    """`directory` will be created (or written into): fail now, naming it, when it or the nearest existing path
    above it is a file — not after the sampling or training whose results would go there."""
    for existing in (directory, *directory.parents):
        if existing.exists():
            if not existing.is_dir():
                raise error(f"{option} {directory}: {existing} is a file, not a directory")
            return


def refuse_an_unwritable_place(directory: Path, option: str, error: type[TltError] = TltError) -> None:
    """As `refuse_a_file_in_the_way`, and the nearest existing directory (`directory` itself, or the one its
    missing parts would be made in) must take a file: a read-only mount or a missing permission fails now, not
    after the sampling or training whose results would be written there. Nothing is created."""
    directory = Path(directory)
    refuse_a_file_in_the_way(directory, option, error)
    existing = next((path for path in (directory, *directory.parents) if path.exists()), None)
    if existing is None:
        return
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise error(f"{option} {directory}: cannot write in {existing} ({exc.strerror})") from None


def file_crc32(path: Path) -> int:
    """CRC32 of a file, read in 64 MiB blocks (~3 GB/s: ~0.5 s for a 135M-parameter policy and its Adam state)."""
    crc = 0
    with open(path, "rb") as file:
        while block := file.read(1 << 26):
            crc = zlib.crc32(block, crc)
    return crc


# A safetensors file's own metadata key: the CRC32 of its tensor bytes (save_checked_tensors). In the file itself,
# so that a save is one atomic rename (a CRC kept in a file beside it went stale when a save was killed between
# the two: review).
CRC_KEY = "tensors_crc32"


class DamagedFileError(TltError):
    """A file whose bytes are not those written."""


def save_checked_tensors(path: Path, tensors: dict) -> None:
    """`tensors` as a safetensors file (written whole) keeping the CRC32 of its tensor bytes in its metadata:
    bytes changed inside a file of intact size and header (a disk or copy error) loaded without a word (QA). The
    tensor bytes do not depend on the metadata, so the CRC of a first serialization holds for the second."""
    import safetensors.torch

    first = safetensors.torch.save(tensors, metadata={"format": "pt"})
    crc = zlib.crc32(memoryview(first)[_tensors_start(first):])
    payload = safetensors.torch.save(tensors, metadata={"format": "pt", CRC_KEY: str(crc)})
    write_whole(Path(path), lambda where: where.write_bytes(payload))


def load_checked_tensors(path: Path) -> dict:
    """The tensors of a safetensors file, checked against the CRC32 its metadata keeps (files written without
    one load unchecked); DamagedFileError when they differ. A file cut short fails in safetensors' own load."""
    import json

    import safetensors.torch

    data = Path(path).read_bytes()
    tensors = safetensors.torch.load(data)
    start = _tensors_start(data)
    expected = (json.loads(data[8:start]).get("__metadata__") or {}).get(CRC_KEY)
    if expected is not None and str(zlib.crc32(memoryview(data)[start:])) != expected:
        raise DamagedFileError(f"{Path(path).name}'s bytes are not those written (CRC32 differs): the file was "
                               f"damaged after the save")
    return tensors


def _tensors_start(data: bytes) -> int:
    """Where a safetensors file's tensor bytes start: after its header's 8-byte length and the header's JSON."""
    return 8 + int.from_bytes(data[:8], "little")


def check_writable(path, option: str) -> None:
    """A file the command will write at its end: its directory is made now, and a directory in its place fails
    (so does a path written as one: `out/` became a file named out)."""
    if str(path).endswith(("/", os.sep)):
        raise TltError(f"{option} {path} names a directory; give a file name (e.g. {str(path).rstrip('/' + os.sep)}"
                       f"/result.json)")
    path = Path(path)
    if path.is_dir():
        raise TltError(f"{option} {path} is a directory; give a file name")
    refuse_a_file_in_the_way(path.parent, option)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise TltError(f"{option} {path}: cannot create {path.parent} ({error.strerror})") from None
    try:  # a read-only mount or a missing permission fails before the work, not after it; the path itself is
        # not touched (a file there may be another process's, a symlink the user's)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as error:
        raise TltError(f"{option} {path}: cannot write in {path.parent} ({error.strerror})") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise TltError(f"{option} {path}: cannot write it (permission denied)")
