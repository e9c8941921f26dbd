"""The training corpus: the running interpreter's standard library sources.

Every Python install carries these files, so the corpus needs no download.
The split is BY FILE (a held-out file never contributes a token to training)
and a pure function of each file's path relative to the stdlib root, so the
same CPython minor version gives the same train and held-out sets on every
machine. Distributions can patch or trim the stdlib; :func:`fingerprint`
hashes names and contents so a model's metadata records exactly which text it
saw. Batches are a pure function of the step, so a resumed run replays the
same token stream.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..progress import bar

# Directories that hold tests, third-party code, generated tables or data, not library code.
EXCLUDED_DIRS = frozenset({
    "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
    "encodings", "pydoc_data",
})  # fmt: skip
HELD_OUT_FRACTION = 0.05
DOCUMENT_SEPARATOR = "<|endoftext|>"
TOKENIZE_BATCH = 32  # texts per encode_batch call: parallel inside, a bar step between


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Optional[Path] = None) -> list[str]:
    """Relative POSIX paths of the library's ``.py`` files, sorted.

    Test directories, installed packages, codec tables, pydoc's topic dump and
    the build-specific ``_sysconfigdata_*`` module are left out.

    Raises:
        FileNotFoundError: ``root`` holds no Python sources.
    """
    root = Path(root) if root is not None else stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        if path.is_file():
            files.append(rel.as_posix())
    if not files:
        raise FileNotFoundError(f"No Python sources under {root}: is this the standard library?")
    return sorted(files)


def is_held_out(rel_path: str, fraction: float = HELD_OUT_FRACTION) -> bool:
    """Whether a file belongs to the held-out set: the first 8 bytes of
    SHA-256(path) read as a fraction of 2**64, below ``fraction``."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


@dataclass(frozen=True)
class CorpusSplit:
    root: Path
    train: tuple[str, ...]
    held_out: tuple[str, ...]

    def texts(self, which: str) -> list[str]:
        """The contents of the ``"train"`` or ``"held_out"`` files, in path order."""
        return [read_source(self.root / rel) for rel in getattr(self, which)]


def split_corpus(root: Optional[Path] = None, fraction: float = HELD_OUT_FRACTION) -> CorpusSplit:
    """The stdlib corpus split by file into train and held-out sets."""
    if not 0 < fraction < 1:
        raise ValueError(f"held-out fraction must be in (0, 1), got {fraction}")
    root = Path(root) if root is not None else stdlib_root()
    files = corpus_files(root)
    held = tuple(f for f in files if is_held_out(f, fraction))
    train = tuple(f for f in files if not is_held_out(f, fraction))
    return CorpusSplit(root=root, train=train, held_out=held)


def read_source(path: Path) -> str:
    """A source file's text, with a clear error for an undecodable file."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None


def fingerprint(root: Path, files: Sequence[str]) -> str:
    """SHA-256 over each file's relative path and bytes: equal means the same corpus."""
    h = hashlib.sha256()
    for rel in files:
        data = (Path(root) / rel).read_bytes()
        h.update(rel.encode("utf-8") + b"\0" + len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


def tokenize_documents(tokenizer, texts: Sequence[str], *, label: Optional[str] = None) -> np.ndarray:
    """One int32 token stream: every text followed by the document separator.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (fast, batched encoding). With
    a ``label``, a progress bar counts the characters encoded (the whole
    stdlib takes seconds), so texts go in batches of ``TOKENIZE_BATCH``.
    """
    sep = tokenizer.token_to_id(DOCUMENT_SEPARATOR)
    if sep is None:
        raise ValueError(f"the tokenizer has no {DOCUMENT_SEPARATOR} token")
    texts, encoded = list(texts), []
    with bar(sum(map(len, texts)), label or "", unit="char", unit_scale=True, show=label is not None) as chars:
        for i in range(0, len(texts), TOKENIZE_BATCH):
            batch = texts[i : i + TOKENIZE_BATCH]
            encoded += tokenizer.encode_batch(batch, add_special_tokens=False)
            chars.update(sum(map(len, batch)))
    parts = [np.asarray(e.ids + [sep], dtype=np.int32) for e in encoded]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


@dataclass(frozen=True)
class TokenBatches:
    """Step -> batch over fixed windows of a token stream.

    The stream is cut into ``len(tokens) // (seq_len + 1)`` non-overlapping
    windows; each epoch visits all of them in a permutation seeded by
    ``(seed, epoch)``, ``batch_size`` windows per step. A batch is an int32
    ``[batch_size, seq_len + 1]`` array (inputs ``[:, :-1]``, targets ``[:, 1:]``).
    """

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    seed: int = 0

    def __post_init__(self):
        if self.seq_len < 1 or self.batch_size < 1:
            raise ValueError("seq_len and batch_size must be >= 1")
        if self.num_windows < self.batch_size:
            raise ValueError(
                f"{len(self.tokens)} tokens make {self.num_windows} windows of "
                f"{self.seq_len + 1}, fewer than batch_size={self.batch_size}"
            )

    @property
    def num_windows(self) -> int:
        return len(self.tokens) // (self.seq_len + 1)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_windows // self.batch_size

    def window_ids(self, step: int) -> np.ndarray:
        epoch, index = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        return order[index * self.batch_size : (index + 1) * self.batch_size]

    def __call__(self, step: int) -> mx.array:
        width = self.seq_len + 1
        windows = self.tokens[: self.num_windows * width].reshape(self.num_windows, width)
        return mx.array(windows[self.window_ids(step)])


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: Optional[int] = None) -> np.ndarray:
    """Non-overlapping ``[n, seq_len + 1]`` windows of held-out tokens, in order."""
    width = seq_len + 1
    n = len(tokens) // width
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"{len(tokens)} held-out tokens are fewer than one window of {width}")
    return tokens[: n * width].reshape(n, width)
