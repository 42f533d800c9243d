"""Packed documents in the data module: the documents of a token file, their greedy packing into rows (long ones
split or refused), each row's labels, positions and document ids, layout invariance, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_moe.data import TokenDataModule, write_tokens
from lightning_moe.documents import IGNORE, PackedDocumentDataset, document_spans, pack_rows

EOD = 1


def _file(tmp_path, lengths, tail=0):
    """Documents of the given lengths (each ends with EOD; its other tokens are its index + 2), then ``tail`` tokens
    without an EOD."""
    toks = np.concatenate([np.r_[np.full(n - 1, 2 + i), EOD] for i, n in enumerate(lengths)] + [np.full(tail, 99)])
    return write_tokens(str(tmp_path / "docs.bin"), toks.astype(np.uint16)), toks


def test_spans_and_packing():
    toks = np.array([5, 5, EOD, 6, EOD, 7, 7, 7])
    starts, lengths = document_spans(toks, EOD)
    assert starts.tolist() == [0, 3, 5] and lengths.tolist() == [3, 2, 3]  # the tail is a document too
    seg_start, seg_len, _, row_ptr = pack_rows(np.array([0, 10, 30]), np.array([10, 20, 9]), row_len=12, seed=0)
    rows = [[(int(seg_start[k]), int(seg_len[k])) for k in range(row_ptr[r], row_ptr[r + 1])]
            for r in range(len(row_ptr) - 1)]
    assert all(sum(n for _, n in row) <= 12 for row in rows)
    covered = sorted((s, n) for row in rows for s, n in row)
    assert covered == [(0, 10), (10, 12), (22, 8), (30, 9)]  # every token once; the 20-token document in 2 pieces
    with pytest.raises(ValueError, match=r"document 1 of 'f.bin' .* has 20 tokens, more than seq_length = 12"):
        pack_rows(np.array([0, 10, 30]), np.array([10, 20, 9]), 12, 0, "refuse", "f.bin")


@pytest.mark.parametrize("multiple", [1, 4])
def test_rows_keep_documents_apart(tmp_path, multiple):
    path, toks = _file(tmp_path, [5, 9, 3, 14, 6, 2])
    ds = PackedDocumentDataset(path, "uint16", 16, seed=0, eod=EOD, multiple=multiple)
    whole = set()
    for i in range(ds.rows):
        item, r = ds[i], ds.row(i)
        # the reference: each segment's tokens, padded to the multiple within its document, then the row's padding
        # (EOD tokens, a document of its own); targets only inside a document's real tokens
        row, doc, labels = [], [], []
        segs = range(ds.row_ptr[r], ds.row_ptr[r + 1])
        for d, k in enumerate(segs):
            s0, n = int(ds.seg_start[k]), int(ds.seg_len[k])
            padded = -(-n // multiple) * multiple
            assert int(ds.seg_padded[k]) == padded
            row += toks[s0:s0 + n].tolist() + [EOD] * (padded - n)
            labels += toks[s0 + 1:s0 + n].tolist() + [IGNORE] * (padded - n + 1)
            doc += [d] * padded
            whole.add(tuple(toks[s0:s0 + n]))
        pad = 16 - len(row)
        row, doc, labels = row + [EOD] * pad, doc + [len(segs)] * pad, labels + [IGNORE] * pad
        pos = [t - doc.index(doc[t]) for t in range(16)]
        assert item["input_ids"].tolist() == row and item["labels"].tolist() == labels
        assert item["position_ids"].tolist() == pos and item["document_ids"].tolist() == doc
    assert tuple(np.r_[np.full(13, 5), EOD]) in whole  # the 14-token document fits a row whole
    assert ds.row(0) != ds.row(ds.rows) or ds.rows == 1  # each epoch its own order
    flat = PackedDocumentDataset(path, "uint16", 16, seed=0, eod=EOD, reset_positions=False)
    assert (flat[0]["position_ids"].numpy() == np.arange(16)).all()


def test_long_documents_split_or_refused(tmp_path):
    path, _ = _file(tmp_path, [4, 40, 6])
    ds = PackedDocumentDataset(path, "uint16", 16, seed=0, eod=EOD)
    # the 40-token document (file tokens 4..43) goes in row-sized pieces, each a document of its own
    pieces = sorted((int(s0), int(n)) for s0, n in zip(ds.seg_start, ds.seg_len) if 4 <= s0 < 44)
    assert pieces == [(4, 16), (20, 16), (36, 8)]
    with pytest.raises(ValueError, match=r"long_documents='refuse': document 1 of .* has 40 tokens"):
        PackedDocumentDataset(path, "uint16", 16, seed=0, eod=EOD, long_documents="refuse")


def test_data_module_packs_layout_invariantly(tmp_path):
    path, _ = _file(tmp_path, [5, 9, 3, 14, 6, 2, 11, 7] * 6)
    rows = []
    for size in (1, 2):
        got = []
        for rank in range(size):
            dm = TokenDataModule(path=path, seq_length=16, batch_size=4 // size, pack_documents=True,
                                 eod_token_id=EOD, seed=3)
            dm.set_data_parallel(rank, size)
            got.append(next(iter(dm.train_dataloader())))
        rows.append({k: torch.cat([g[k] for g in got]) for k in got[0]})
    for k in rows[0]:
        assert torch.equal(rows[0][k], rows[1][k]), k
    assert set(rows[0]) == {"input_ids", "labels", "position_ids", "document_ids"}


def test_refusals(tmp_path):
    path, _ = _file(tmp_path, [5, 9, 3])
    with pytest.raises(ValueError, match="eod_token_id: pack_documents needs the end-of-document token id"):
        TokenDataModule(path=path, seq_length=8, pack_documents=True)
    with pytest.raises(ValueError, match="long_documents must be one of"):
        TokenDataModule(path=path, seq_length=8, pack_documents=True, eod_token_id=EOD, long_documents="drop")
    with pytest.raises(ValueError, match="document_multiple must be an integer >= 1 dividing seq_length=8"):
        TokenDataModule(path=path, seq_length=8, pack_documents=True, eod_token_id=EOD, document_multiple=3)
    with pytest.raises(ValueError, match="eod_token_id must be a token id of dtype uint16"):
        TokenDataModule(path=path, seq_length=8, pack_documents=True, eod_token_id=-1)
    dm = TokenDataModule(path=path, seq_length=8, pack_documents=True, eod_token_id=77)
    with pytest.raises(ValueError, match="eod_token_id=77: .* has no such token"):
        dm.train_dataloader()
