"""Packed documents: whole documents laid end to end in rows, with what attention and the loss need to keep them apart.

A token file holds documents separated by an end-of-document token (EOD), which ends its document; tokens after the
last EOD form one more document. Rows of S tokens are packed greedily from the documents in a seeded order, and the
rest of a row is padding. A document longer than a row is split into row-sized pieces (``long_documents="split"``,
each piece a document of its own, as Megatron splits them) or refused (``"refuse"``). With ``multiple`` m > 1 every
document (and piece) is padded to a multiple of m tokens: context parallelism splits each document into 2·CP equal
chunks (m = 2·CP), as Megatron's THD layout does. Item ``i`` of the dataset:

  input_ids (S)     the row's tokens (padding: EOD tokens)
  labels (S)        the next token within the same document; -100 after a document's last token (its EOD), in
                    padding, and at the row's end
  position_ids (S)  each token's position within its document (``reset_positions``) or within the row
  document_ids (S)  which document of the row each token belongs to; a document's padding belongs to it, the row's
                    padding is one more document

Sampling is layout-invariant, as for windows: item ``i`` is row ``perm_e(i mod R)`` of epoch ``e = i // R``, a pure
function of ``(seed, stream, i)``.
"""

from __future__ import annotations

import sys
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

IGNORE = -100
LONG_DOCUMENTS = ("split", "refuse")


def document_spans(tokens: np.ndarray, eod: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the documents of a flat token array; each includes its EOD."""
    ends = np.flatnonzero(tokens == eod) + 1
    if ends.size == 0 or ends[-1] != tokens.size:
        ends = np.append(ends, tokens.size)
    starts = np.concatenate([[0], ends[:-1]])
    return starts.astype(np.int64), (ends - starts).astype(np.int64)


def pack_rows(starts: np.ndarray, lengths: np.ndarray, row_len: int, seed: int, long_documents: str = "split",
              path: str = "", multiple: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Greedy packing of the documents, in a seeded order, into rows of ``row_len`` tokens, each document padded to a
    multiple of ``multiple``: the segments' file starts, real and padded lengths, and each row's first segment
    (``row_ptr``, one more entry than rows)."""
    if long_documents not in LONG_DOCUMENTS:
        raise ValueError(f"long_documents must be one of {LONG_DOCUMENTS}, got {long_documents!r}")
    if row_len % multiple:
        raise ValueError(f"seq_length={row_len} is not a multiple of document_multiple={multiple}")
    too_long = np.flatnonzero(lengths > row_len)
    if too_long.size and long_documents == "refuse":
        i = int(too_long[0])
        raise ValueError(f"long_documents='refuse': document {i} of {path!r} (tokens {starts[i]}.."
                         f"{starts[i] + lengths[i]}) has {lengths[i]} tokens, more than seq_length = {row_len}; raise "
                         "seq_length, or set "
                         f"long_documents='split' ({too_long.size} such documents)")
    seg_start, seg_len, seg_padded, row_ptr, fill = [], [], [], [0], 0
    for d in np.random.default_rng([seed, 7]).permutation(lengths.size):
        s, n = int(starts[d]), int(lengths[d])
        while n > 0:  # a long document goes in row-sized pieces
            piece = min(n, row_len)
            padded = -(-piece // multiple) * multiple
            if fill + padded > row_len:
                row_ptr.append(len(seg_start))
                fill = 0
            seg_start.append(s)
            seg_len.append(piece)
            seg_padded.append(padded)
            fill += padded
            s, n = s + piece, n - piece
    row_ptr.append(len(seg_start))
    return (np.asarray(seg_start, np.int64), np.asarray(seg_len, np.int64), np.asarray(seg_padded, np.int64),
            np.asarray(row_ptr, np.int64))


class PackedDocumentDataset(Dataset):
    """Map-style dataset over the global sample index (unbounded, like ``TokenWindowDataset``): item ``i`` is one
    packed row (see the module docstring)."""

    def __init__(self, path: str, dtype: str, seq_length: int, seed: int, eod: int, stream: int = 0,
                 reset_positions: bool = True, long_documents: str = "split", multiple: int = 1):
        from lightning_moe.data import _DTYPES
        tokens = np.memmap(path, dtype=_DTYPES[dtype], mode="r")
        if not (tokens == eod).any():
            raise ValueError(f"eod_token_id={eod}: {path!r} has no such token; pack_documents needs documents "
                             "separated by the end-of-document token")
        self.path, self.dtype, self.seq_length, self.seed, self.eod = path, dtype, seq_length, seed, eod
        self.stream, self.reset_positions = stream, reset_positions
        starts, lengths = document_spans(tokens, eod)
        self.seg_start, self.seg_len, self.seg_padded, self.row_ptr = pack_rows(
            starts, lengths, seq_length, seed, long_documents, path, multiple)
        self.rows = self.row_ptr.size - 1
        self._tokens: Optional[np.ndarray] = None
        self._epoch, self._perm = -1, None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None, "_epoch": -1, "_perm": None}

    def __len__(self) -> int:
        return sys.maxsize

    def row(self, i: int) -> int:
        epoch, j = divmod(int(i), self.rows)
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, self.stream, epoch]).permutation(self.rows)
            self._epoch = epoch
        return int(self._perm[j])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i < 0:
            raise IndexError(f"global sample index must be >= 0, got {i}")
        if self._tokens is None:
            from lightning_moe.data import _DTYPES
            self._tokens = np.memmap(self.path, dtype=_DTYPES[self.dtype], mode="r")
        r = self.row(i)
        segs = range(int(self.row_ptr[r]), int(self.row_ptr[r + 1]))
        S = self.seq_length
        ids = np.full(S, self.eod, dtype=np.int64)
        labels = np.full(S, IGNORE, dtype=np.int64)
        doc = np.full(S, len(segs), dtype=np.int64)  # the row's padding: one more document
        pos = np.arange(S, dtype=np.int64)
        at = 0
        for d, k in enumerate(segs):
            s, n, padded = int(self.seg_start[k]), int(self.seg_len[k]), int(self.seg_padded[k])
            ids[at:at + n] = self._tokens[s:s + n]
            labels[at:at + n - 1] = ids[at + 1:at + n]  # targets within the document only
            doc[at:at + padded] = d
            if self.reset_positions:
                pos[at:at + padded] = np.arange(padded)
            at += padded
        if self.reset_positions:
            pos[at:] = np.arange(S - at)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(pos), "document_ids": torch.from_numpy(doc)}
