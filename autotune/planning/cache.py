"""Probe results stored on disk, keyed by everything that changes the answer.

Files live in ``$XDG_CACHE_HOME/autotune`` (default ``~/.cache/autotune``), one JSON file per key.
A file that cannot be read is ignored with a one-line warning on stderr, never fatal.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["cache_dir", "cache_key", "load", "own_code", "source_hash", "store", "warn"]


def warn(message: str) -> None:
    """A cache problem, said in one line on stderr (it never stops the command)."""
    print(f"autotune: warning: {message}", file=sys.stderr)


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/autotune``, or ``~/.cache/autotune``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autotune"


def cache_key(parts: dict[str, Any]) -> str:
    """A stable hash of ``parts`` (JSON with sorted keys; other values by ``str``)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@functools.cache
def own_code() -> str:
    """A hash of autotune's own source (:func:`source_hash` of the package), part of every key: a checkout updated in
    place, with the same version number, does not answer from a plan that other code made. Read once a process."""
    return source_hash(Path(__file__).resolve().parents[1])


def source_hash(root: Path) -> str:
    """A hash of every ``.py`` file under ``root``: their names (relative to it) and contents."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def load(key: str) -> dict[str, Any] | None:
    """The entry stored under ``key``, or None (missing, or unreadable: then with a warning)."""
    path = cache_dir() / f"{key}.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (OSError, ValueError) as exc:
        warn(f"ignoring the unreadable cache file {path} ({exc}); probing again")
        return None


def store(key: str, data: dict[str, Any]) -> Path | None:
    """Write ``data`` under ``key`` (atomically); a cache that cannot be written is skipped."""
    directory = cache_dir()
    path = directory / f"{key}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as exc:
        warn(f"could not write the cache file {path} ({exc})")
        return None
    return path
