"""Data for ``python -m infinity.train``: texts, an offline byte-level tokenizer, batches.

Note [batches across ranks]: the token stream is cut into windows of ``seq_len + 1`` tokens
(inputs are the first ``seq_len``, targets the last ``seq_len``). Each optimizer step takes
one *global* batch of ``micro_batch_size x accumulation x world`` windows from a permutation
seeded by the config seed; micro-step ``a`` uses the ``a``-th block of ``micro x world``
windows and rank ``r`` takes every ``world``-th of them starting at ``r``. So the windows a
step trains on do not depend on the world size, and N ranks see the same global batch as
one rank: the per-rank mean losses average to the one-rank loss.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

import torch

from .._runtime._log import logger
from ..errors import DataError

# ---------------------------------------------------------------------------------------------
# Tokenizers


class ByteTokenizer:
    """UTF-8 bytes are tokens 0-255; 256 ends a document, 257 pads. Needs no files."""

    eos_token_id = 256
    pad_token_id = 257
    vocab_size = 258
    name = "bytes"

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer behind the same two methods."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id
        self.name = type(tokenizer).__name__

    def encode(self, text: str) -> List[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def has_tokenizer_files(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, f)) for f in TOKENIZER_FILES)


def load_hf_tokenizer(directory: str) -> HFTokenizer:
    from transformers import AutoTokenizer  # optional (the hf extra) and slow to import

    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(directory, local_files_only=True))
    except Exception as err:  # transformers raises many kinds for a broken directory
        raise DataError(f"cannot load the tokenizer files in {directory!r}: {err}; fix or remove them "
                        f"(without them the byte-level tokenizer is used when the vocabulary fits)") from err


# ---------------------------------------------------------------------------------------------
# Texts


def read_texts(path: str) -> List[str]:
    """A .txt file is one text; a .jsonl file has one JSON object with a "text" field a line."""
    if not os.path.exists(path):
        raise DataError(f"data file {path!r} does not exist; give an existing .txt or .jsonl file "
                        f"(train.data / --data), or leave it unset for the built-in corpus")
    if os.path.isdir(path):
        raise DataError(f"data path {path!r} is a directory; give a .txt or .jsonl file")
    if path.endswith(".jsonl"):
        return _read_jsonl(path)
    if not path.endswith(".txt"):
        raise DataError(f"data file {path!r}: unknown extension; use .txt (plain text) or .jsonl "
                        f"(one {{\"text\": ...}} object a line)")
    with open(path, "rb") as f:
        return [_decode_text(path, f.read())]


# Note [binary data]: a .txt file that is not text (a model file, an archive, random bytes)
# would train on garbage bytes. Each byte that is not UTF-8, or is NUL, counts as undecodable:
# above BINARY_FRACTION of the file it is refused with the fraction; below, the bytes are
# replaced (U+FFFD) and a warning gives the fraction. A .jsonl line that is not UTF-8 is
# refused naming the line: JSON has no such thing as an undecodable line.
BINARY_FRACTION = 0.01


def _decode_text(path: str, data: bytes) -> str:
    text = data.decode("utf-8", errors="surrogateescape")  # each bad byte becomes one lone surrogate
    bad = sum(1 for ch in text if "\udc80" <= ch <= "\udcff") + text.count("\x00")
    if not bad:
        return text
    fraction = bad / max(1, len(data))
    if fraction > BINARY_FRACTION:
        raise DataError(f"data file {path!r} does not look like text: {bad} of its {len(data)} bytes "
                        f"({fraction:.1%}) are not UTF-8 or are NUL; give a UTF-8 .txt file (or a .jsonl of "
                        f"{{\"text\": ...}} lines)")
    logger.warning("data file %s: %d of its %d bytes (%.3f%%) are not UTF-8 or are NUL; they are replaced by "
                   "U+FFFD and trained on as such", path, bad, len(data), 100 * fraction)
    return text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace").replace("\x00", "\ufffd")


def _read_jsonl(path: str) -> List[str]:
    texts = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                                f"{err.start + 1}); a .jsonl file holds one {{\"text\": ...}} object of UTF-8 "
                                f"text a line") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON ({err}); each line must be an "
                                f"object like {{\"text\": \"...\"}}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise DataError(f"{path}:{lineno}: each line needs a string field \"text\", got "
                                f"{type(obj).__name__} with keys {sorted(obj) if isinstance(obj, dict) else []}")
            texts.append(obj["text"])
    return texts


_SUBJECTS = ["the engine", "rank zero", "every rank", "the prefetcher", "the optimizer", "the swapper",
             "a fetch unit", "the scheduler", "the reducer", "the tokenizer"]
_VERBS = ["gathers", "releases", "writes", "reads", "partitions", "updates", "prefetches", "offloads",
          "reduces", "streams"]
_OBJECTS = ["the shard", "the gradients", "the master weights", "the moments", "the next layer",
            "a bucket", "the activations", "the embedding", "every parameter", "the trace"]
_PLACES = ["to nvme", "from nvme", "to host memory", "from host memory", "on the device", "across ranks",
           "in chunks", "before the step", "after the backward pass", "along the trace"]


def builtin_corpus(sentences: int = 6000, seed: int = 0) -> str:
    """A generated English-like corpus (about 400 kB) with enough structure to learn quickly."""
    rng = random.Random(seed)
    lines = []
    for i in range(sentences):
        s = (f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
             f"{rng.choice(_PLACES)} in {rng.randint(1, 99)} ms.")
        lines.append(s[0].upper() + s[1:])
        if i % 8 == 7:
            lines.append("\n")
    return " ".join(lines).replace(" \n ", "\n")


# ---------------------------------------------------------------------------------------------
# Windows and batches


def token_windows(texts: Sequence[str], tokenizer, seq_len: int) -> torch.Tensor:
    """All texts tokenized, joined by the end-of-text token and cut into (N, seq_len + 1)."""
    ids: List[int] = []
    eos = tokenizer.eos_token_id
    for text in texts:
        ids.extend(tokenizer.encode(text))
        if eos is not None:
            ids.append(eos)
    width = seq_len + 1
    n = len(ids) // width
    if n == 0:
        raise DataError(f"the data has {len(ids)} tokens, fewer than one window of seq_len + 1 = {width}; "
                        f"give more text or lower train.seq_len")
    return torch.tensor(ids[: n * width], dtype=torch.long).view(n, width)


@dataclass
class Batches:
    """Global batches of windows, rank-strided (Note [batches across ranks])."""

    windows: torch.Tensor
    micro_batch_size: int
    accumulation: int
    world_size: int
    rank: int
    seed: int

    def __post_init__(self):
        self._order: Optional[torch.Tensor] = None
        self._epoch = -1

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.accumulation * self.world_size

    def _indices(self, step: int) -> torch.Tensor:
        n = self.windows.size(0)
        g = self.global_batch
        out = []
        start = step * g
        while len(out) < g:
            epoch, pos = divmod(start + len(out), n)
            if epoch != self._epoch:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._order, self._epoch = torch.randperm(n, generator=gen), epoch
            take = min(n - pos, g - len(out))
            out.extend(self._order[pos : pos + take].tolist())
        return torch.tensor(out, dtype=torch.long)

    def step(self, step: int) -> Iterator[tuple]:
        """The (inputs, targets) micro-batches of this rank for optimizer step ``step``."""
        idx = self._indices(step)
        block = self.micro_batch_size * self.world_size
        for a in range(self.accumulation):
            mine = idx[a * block : (a + 1) * block][self.rank :: self.world_size]
            w = self.windows[mine]
            yield w[:, :-1].contiguous(), w[:, 1:].contiguous()
