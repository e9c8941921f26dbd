"""Writing a file so that a reader sees the old one or the new one, never half.

Every file is written to a temporary sibling (same directory, so one rename
replaces it; hidden, keeping the suffix so writers that append one, like
``np.save``, name it as given) and renamed over the target only once written
whole; on any error the temporary is removed and the target is untouched.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield the temporary path to write ``path``'s new content to; it
    replaces ``path`` when the block exits without an error."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path | str, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: Path | str, obj: Any, **dumps: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON (``json.dumps(obj, **dumps)``, then a newline)."""
    write_text_atomic(path, json.dumps(obj, **dumps) + "\n")
