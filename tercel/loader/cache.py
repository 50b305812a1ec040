"""The load cache: what a checkpoint costs to prepare, kept on disk so the next start skips it.

A GGUF file's metadata (the rendered config, the 4-bit share dtype="auto" asks for), its tokenizer
converted to an HF fast tokenizer, and its weights as the CPU runs them (4-bit matrices packed for the
int4 kernel) are each written once, under $TERCEL_CACHE_DIR (default $XDG_CACHE_HOME/tercel, else
~/.cache/tercel), in a folder named by the file's resolved path, size and modification time: a changed
or moved file gets a new entry, never a stale one. Everything here is an optimisation: an entry that
cannot be read or written is logged and the checkpoint is prepared from scratch.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..dev_overrides import cache_dir

log = logging.getLogger(__name__)

# bumped whenever what an entry holds changes shape, so older entries are not read
CACHE_FORMAT = 1


def cache_root() -> Path:
    return cache_dir()


def entry_dir(checkpoint: Path) -> Path:
    """The folder for this file as it is now (path, size, modification time)."""
    path = Path(checkpoint).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{CACHE_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_root() / "checkpoints" / f"{path.name}-{digest}"


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable load cache entry %s (%s)", path, e)
        return None
    return data if isinstance(data, dict) and data.get("format") == CACHE_FORMAT else None


def write_atomically(path: Path, write: Callable[[Path], None]) -> bool:
    """write(tmp) then rename over path, so a reader sees the old entry or the whole new one; a directory
    works the same (write fills tmp, created empty). False (and a log line) when the cache is not writable."""
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
        target = tmp / "x"
        write(target)
        if path.exists() and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        os.replace(target, path)
        return True
    except Exception as e:  # a full disk, a read-only home: the run goes on uncached
        log.warning("could not write the load cache entry %s (%s: %s); the next start prepares it again "
                    "(TERCEL_CACHE_DIR moves the cache)", path, type(e).__name__, e)
        return False
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: Path, data: dict[str, Any]) -> bool:
    def write(target: Path) -> None:
        target.write_text(json.dumps({"format": CACHE_FORMAT, **data}))

    return write_atomically(path, write)
