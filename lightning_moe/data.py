"""Token data: a LightningDataModule over a flat binary token file, with a download-free default corpus.

Sampling is *layout-invariant*: global sample ``i`` is the window at ``start(i)``, a pure function of
``(seed, stream, i)``. Global batch ``g`` holds samples ``[g*GB, (g+1)*GB)`` with ``GB = batch_size * dp_size``, and
data-parallel rank ``r`` takes rows ``[r*batch_size, (r+1)*batch_size)`` of it. So for a fixed global batch the
concatenation over dp ranks is identical whatever the dp size. With gradient accumulation, consecutive micro-batches
of one rank are consecutive *global batches*: invariance holds per micro-batch step (an optimizer step over ``k``
micro-batches sees global batches ``g..g+k-1``), so changing dp while keeping ``batch_size*dp`` fixed keeps the data
identical step for step, while trading dp for accumulation does not.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
from typing import Any, Callable, Iterator, Optional

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_moe.documents import LONG_DOCUMENTS, PackedDocumentDataset

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_BLOCK = 4096  # starts are drawn in blocks so random access to sample i costs one small RNG call
_TRAIN_STREAM, _VAL_STREAM = 0, 1  # separate RNG streams; [seed, stream, block] never collides across seeds
_CORPUS_CAP = 8 * 1024 * 1024
_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
DEFAULT_EOD = 0  # the default corpus's end-of-document token (byte-level: NUL)


def write_tokens(path: str, tokens: Any, dtype: str = "uint16") -> str:
    """Write token ids as a flat binary file, atomically (temp file in the same dir, then ``os.replace``)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    arr = np.asarray(tokens)
    info = np.iinfo(_DTYPES[dtype])
    if arr.size and (arr.min() < 0 or arr.max() > info.max):
        raise ValueError(f"tokens out of range for dtype {dtype}: [{arr.min()}, {arr.max()}]")
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # same-dir temp file: os.replace is atomic only within one filesystem, so concurrent ranks never see half a file
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp_tokens_")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(arr.astype(_DTYPES[dtype], copy=False).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _stdlib_sources() -> list[str]:
    root = os.path.dirname(os.__file__)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files)


def _stdlib_corpus(path: str, separator: bytes) -> str:
    chunks, total = [], 0
    for f in _stdlib_sources():
        if total >= _CORPUS_CAP:
            break
        with open(f, "rb") as fh:
            data = fh.read()
        data = (data.replace(bytes([DEFAULT_EOD]), b"") if separator != b"\n" else data) + separator
        chunks.append(data)
        total += len(data)
    buf = np.frombuffer(b"".join(chunks)[:_CORPUS_CAP], dtype=np.uint8)
    return write_tokens(path, buf.astype(np.uint16), "uint16")


def default_corpus_path(cache_dir: Optional[str] = None, documents: bool = False) -> str:
    """Byte-level tokens (vocab 256, uint16) of this Python's own stdlib source, built once and cached.
    ``documents``: each source file is a document, ended by the token ``DEFAULT_EOD`` (the NUL byte, which source text
    never holds); otherwise the files are joined by newlines.

    Deterministic on one machine: sorted paths, fixed separator, fixed cap. Several ranks may build it at the same
    time; the atomic write makes that harmless (identical content, last ``os.replace`` wins).
    """
    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "lightning_moe")
    path = os.path.join(cache_dir, "stdlib_documents_v1.bin" if documents else "stdlib_bytes_v1.bin")
    if os.path.isfile(path) and os.path.getsize(path) > 0:
        return path
    return _stdlib_corpus(path, bytes([DEFAULT_EOD]) if documents else b"\n")


def _check_token_file(path: str, dtype: str, seq_length: int) -> int:
    """Return the number of tokens in ``path``, raising errors that name the offending field."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path: token file not found: {path!r}")
    itemsize = np.dtype(_DTYPES[dtype]).itemsize
    nbytes = os.path.getsize(path)
    if nbytes % itemsize:
        raise ValueError(f"path: {path!r} has {nbytes} bytes, not a multiple of the {dtype} size {itemsize}")
    n_tokens = nbytes // itemsize
    if n_tokens < seq_length + 1:
        raise ValueError(
            f"path: {path!r} holds {n_tokens} tokens, too short for one window of seq_length + 1 = {seq_length + 1}"
        )
    return n_tokens


class TokenWindowDataset(Dataset):
    """Map-style dataset over *global* sample index: item ``i`` is the window ``tokens[start(i) : start(i)+S+1]``.

    Unbounded (``len`` is ``sys.maxsize``): the sampler decides how much is consumed. The memmap is opened lazily and
    dropped on pickling so DataLoader workers each map the file instead of receiving a copy of it.
    """

    def __init__(self, path: str, dtype: str, seq_length: int, seed: int, stream: int = _TRAIN_STREAM):
        self.path, self.dtype, self.seq_length, self.seed, self.stream = path, dtype, seq_length, seed, stream
        self.n_tokens = _check_token_file(path, dtype, seq_length)
        self._tokens: Optional[np.ndarray] = None
        self._block, self._starts = -1, None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None, "_block": -1, "_starts": None}

    def __len__(self) -> int:
        return sys.maxsize

    def start(self, i: int) -> int:
        block = i // _BLOCK
        if block != self._block:
            rng = np.random.default_rng([self.seed, self.stream, block])
            # high is exclusive: the last valid start n - S - 1 makes the window end exactly at the file end
            self._starts = rng.integers(0, self.n_tokens - self.seq_length, size=_BLOCK, dtype=np.int64)
            self._block = block
        return int(self._starts[i % _BLOCK])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i < 0:
            raise IndexError(f"global sample index must be >= 0, got {i}")
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=_DTYPES[self.dtype], mode="r")
        s = self.start(int(i))
        window = torch.from_numpy(np.array(self._tokens[s : s + self.seq_length + 1], dtype=np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}


class GlobalBatchSampler(DistributedSampler):
    """Yields this dp rank's rows of global batches ``first, first+1, ...`` (``first = start_batch + epoch*num_batches``).

    Subclasses ``DistributedSampler`` on purpose: Lightning's data connector (``_requires_distributed_sampler``) wraps
    *any* sampler that is not a ``DistributedSampler`` in a ``DistributedSamplerWrapper`` when distributed and
    ``use_distributed_sampler=True`` (custom samplers included), which would re-shard our already-sharded indices.
    ``start_batch`` is a plain attribute so an exact resume can set it to the number of global batches consumed.
    """

    def __init__(self, dataset: Dataset, batch_size: int, num_batches: int, rank: int = 0, size: int = 1,
                 start_batch: int = 0, advance_per_epoch: bool = True):
        if not 0 <= rank < size:
            raise ValueError(f"rank: must satisfy 0 <= rank < size, got rank={rank}, size={size}")
        # deliberately not calling DistributedSampler.__init__: it sizes itself from len(dataset) (unbounded here)
        self.dataset, self.num_replicas, self.rank = dataset, size, rank
        self.batch_size, self.num_batches, self.start_batch = batch_size, num_batches, start_batch
        self.advance_per_epoch, self.epoch, self.shuffle, self.drop_last, self.seed = advance_per_epoch, 0, False, True, 0
        self.num_samples = num_batches * batch_size
        self.total_size = self.num_samples * size
        self.resume_skip = 0  # global batches of the current epoch already consumed before a resume (next pass only)

    def __iter__(self) -> Iterator[int]:
        # a new epoch continues the stream rather than repeating it (the val set stays fixed)
        first = self.start_batch + (self.epoch * self.num_batches if self.advance_per_epoch else 0)
        skip, self.resume_skip = self.resume_skip, 0
        gb = self.batch_size * self.num_replicas
        for g in range(first + skip, first + self.num_batches):
            base = g * gb + self.rank * self.batch_size
            yield from range(base, base + self.batch_size)

    def __len__(self) -> int:
        return self.num_samples


class ResumableLoader(DataLoader):
    """The training loader, resumable mid-epoch through Lightning's stateful-dataloader interface: its state is the
    number of batches of the current epoch that training consumed (read from the trainer's progress, so prefetching
    does not count), and a restored loader starts its next pass right after them."""

    def __init__(self, *args, consumed: Callable[[], int], **kwargs):
        super().__init__(*args, **kwargs)
        self._consumed = consumed

    def state_dict(self) -> dict:
        return {"batches_in_epoch": int(self._consumed())}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.resume_skip = int(state.get("batches_in_epoch", 0))


class TokenDataModule(pl.LightningDataModule):
    """Seeded, layout-invariant random windows over a flat token file (see the module docstring).

    ``batch_size`` is the per-dp-rank micro-batch; ``train_samples`` (global samples per epoch) only gives the loader a
    length, so ``Trainer(max_steps=...)`` governs training. dp size/rank come from the strategy's
    ``distributed_sampler_kwargs`` (the strategy must report the *data-parallel* size/rank, so that tp/cp/pp peers read
    the same rows) unless :meth:`set_data_parallel` was called.
    """

    def __init__(self, path: Optional[str] = None, dtype: str = "uint16", seq_length: int = 128, batch_size: int = 8,
                 seed: int = 1234, val_batches: int = 4, num_workers: int = 0, cache_dir: Optional[str] = None,
                 train_samples: int = 10**7, pack_documents: bool = False, eod_token_id: Optional[int] = None,
                 reset_positions: bool = True, long_documents: str = "split", document_multiple: int = 1):
        """``pack_documents``: rows of whole documents separated by ``eod_token_id`` (``lightning_moe.documents``),
        with position and document ids so that attention stays within each document and the loss skips the targets
        across documents. ``reset_positions``: positions restart at each document. ``long_documents``: ``"split"`` a
        document longer than a row into pieces, or ``"refuse"`` it. ``document_multiple``: pad every document to a
        multiple of it (2 x context_parallel_size under CP). The default corpus has one document per source file and
        ``eod_token_id`` 0."""
        super().__init__()
        for name, value, low in (("seq_length", seq_length, 1), ("batch_size", batch_size, 1),
                                 ("val_batches", val_batches, 0), ("num_workers", num_workers, 0),
                                 ("train_samples", train_samples, 1)):
            if int(value) != value or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if pack_documents:
            if eod_token_id is None and path is not None:
                raise ValueError("eod_token_id: pack_documents needs the end-of-document token id of the token file "
                                 f"{path!r} (the default corpus uses {DEFAULT_EOD})")
            eod_token_id = DEFAULT_EOD if eod_token_id is None else eod_token_id
            if int(eod_token_id) != eod_token_id or not 0 <= eod_token_id <= np.iinfo(_DTYPES[dtype]).max:
                raise ValueError(f"eod_token_id must be a token id of dtype {dtype}, got {eod_token_id!r}")
            if long_documents not in LONG_DOCUMENTS:
                raise ValueError(f"long_documents must be one of {LONG_DOCUMENTS}, got {long_documents!r}")
            if int(document_multiple) != document_multiple or document_multiple < 1 or seq_length % document_multiple:
                raise ValueError(f"document_multiple must be an integer >= 1 dividing seq_length={seq_length}, got "
                                 f"{document_multiple!r}")
        self.pack_documents, self.eod_token_id = pack_documents, eod_token_id
        self.reset_positions, self.long_documents = reset_positions, long_documents
        self.document_multiple = document_multiple
        self.path, self.dtype, self.seq_length, self.batch_size = path, dtype, seq_length, batch_size
        self.seed, self.val_batches, self.num_workers, self.cache_dir = seed, val_batches, num_workers, cache_dir
        self.train_samples = train_samples
        self._dp: Optional[tuple[int, int]] = None  # (rank, size) override
        if path is not None:  # fail fast (before any process is launched) on a wrong path
            _check_token_file(path, dtype, seq_length)
        self._resolved_path: Optional[str] = None
        self._packed: Optional[PackedDocumentDataset] = None
        self._vocab_checked: Optional[tuple] = None

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the file and the first token id >= ``vocab_size`` (the model's), before any step: an
        out-of-range id would index past the embedding. Scanned once per file and vocabulary, in bounded chunks."""
        if self._resolved_path is None:
            self.setup()
        if self._vocab_checked == (self._resolved_path, vocab_size):
            return
        tokens = np.memmap(self._resolved_path, dtype=_DTYPES[self.dtype], mode="r")
        step = 1 << 24
        for start in range(0, tokens.size, step):
            bad = np.flatnonzero(tokens[start:start + step] >= vocab_size)
            if bad.size:
                i = start + int(bad[0])
                raise ValueError(f"path: {self._resolved_path!r} holds token id {int(tokens[i])} at index {i}, not "
                                 f"below the model's vocab_size={vocab_size} (model.overrides.vocab_size); tokenize "
                                 "with the model's tokenizer or raise vocab_size")
        self._vocab_checked = (self._resolved_path, vocab_size)

    def set_data_parallel(self, rank: int, size: int) -> None:
        """Override the data-parallel rank/size (tests, non-Lightning use)."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank/size: need size >= 1 and 0 <= rank < size, got rank={rank}, size={size}")
        self._dp = (rank, size)

    def data_parallel(self) -> tuple[int, int]:
        """(rank, size): the override, else the strategy's ``distributed_sampler_kwargs``, else (0, 1)."""
        if self._dp is not None:
            return self._dp
        trainer = getattr(self, "trainer", None)
        try:  # single-device strategies lack the attribute; some raise before their mesh exists
            kw = trainer.strategy.distributed_sampler_kwargs if trainer is not None else None
        except (AttributeError, AssertionError):
            kw = None
        if isinstance(kw, dict) and "num_replicas" in kw and "rank" in kw and kw["num_replicas"] >= 1:
            return int(kw["rank"]), int(kw["num_replicas"])
        return 0, 1

    def prepare_data(self) -> None:
        if self.path is None:  # local rank 0 builds the cache; setup() on other ranks reuses it (or rebuilds atomically)
            default_corpus_path(self.cache_dir, self.pack_documents)

    def setup(self, stage: Optional[str] = None) -> None:
        path = self.path if self.path is not None else default_corpus_path(self.cache_dir, self.pack_documents)
        _check_token_file(path, self.dtype, self.seq_length)
        if path != self._resolved_path:  # the packing is kept across stages (fit, then validate)
            self._packed = None
        self._resolved_path = path

    def _loader(self, stream: int, num_batches: int, advance: bool, **extra) -> DataLoader:
        if self._resolved_path is None:
            self.setup()
        rank, size = self.data_parallel()
        ds = self._dataset(stream)
        sampler = GlobalBatchSampler(ds, self.batch_size, num_batches, rank, size, advance_per_epoch=advance)
        cls = ResumableLoader if extra else DataLoader
        return cls(ds, batch_size=self.batch_size, sampler=sampler, shuffle=False, drop_last=True,
                   num_workers=self.num_workers, persistent_workers=self.num_workers > 0, **extra)

    def _dataset(self, stream: int) -> Dataset:
        if not self.pack_documents:
            return TokenWindowDataset(self._resolved_path, self.dtype, self.seq_length, self.seed, stream)
        if self._packed is None:  # the packing is the same for both streams: computed once
            self._packed = PackedDocumentDataset(self._resolved_path, self.dtype, self.seq_length, self.seed,
                                                 self.eod_token_id, stream, self.reset_positions, self.long_documents,
                                                 self.document_multiple)
        ds = copy.copy(self._packed)
        ds.stream, ds._epoch = stream, -1
        return ds

    def _train_batches_in_epoch(self) -> int:
        # checkpoints are written at optimizer-step boundaries: every batch of the finished steps was consumed
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0
        consumed = trainer.global_step * trainer.accumulate_grad_batches
        per_epoch = trainer.num_training_batches
        return consumed - trainer.current_epoch * per_epoch if per_epoch != float("inf") else consumed

    def train_dataloader(self) -> DataLoader:
        _, size = self.data_parallel()
        return self._loader(_TRAIN_STREAM, max(1, self.train_samples // (self.batch_size * size)), advance=True,
                            consumed=self._train_batches_in_epoch)

    def val_dataloader(self) -> DataLoader:
        return self._loader(_VAL_STREAM, self.val_batches, advance=False)
