"""Context parallelism on packed documents (Megatron's THD layout): every document is cut into 2·CP equal chunks, and
CP rank r holds chunk r and chunk 2·CP-1-r of each, so that every rank gets the same share of every document and the
causal work stays balanced whatever the lengths. Documents must be padded to multiples of 2·CP
(``TokenDataModule(document_multiple=2 * cp)``).

The K/V all-gather of ``context_parallel.py`` is kept: each rank attends its queries to every rank's keys, in rank-major
order, under a mask that allows a key of the same document at an earlier or equal row position (a dense boolean mask,
or on CUDA a FlexAttention BlockMask: ``document_mask.py``). The index arithmetic runs on the device from the document
ids: no host sync.

Shapes: B rows, S row length, s = S / cp local tokens.
"""

from __future__ import annotations

import torch


def _document_extent(document_ids_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's offset in its document and its document's length."""
    B, S = document_ids_BS.shape
    t_S = torch.arange(S, device=document_ids_BS.device)
    first_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
    first_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    start_BS = torch.cummax(torch.where(first_BS, t_S, 0), dim=1).values
    last_BS = torch.ones_like(first_BS)
    last_BS[:, :-1] = first_BS[:, 1:]
    end_BS = torch.cummin(torch.where(last_BS, t_S, S).flip(1), dim=1).values.flip(1)
    return t_S - start_BS, end_BS - start_BS + 1


def check_document_lengths(document_ids_BS: torch.Tensor, cp: int) -> None:
    """Every document's length a multiple of 2·cp: an error on the CPU, a device-side assert on CUDA (no sync)."""
    _, n_BS = _document_extent(document_ids_BS)
    ok = (n_BS % (2 * cp) == 0).all()
    msg = (f"context parallelism on packed documents needs every document padded to a multiple of 2 x "
           f"context_parallel_size = {2 * cp}: set TokenDataModule(document_multiple={2 * cp})")
    if document_ids_BS.is_cuda:
        torch._assert_async(ok, msg)
    elif not bool(ok):
        raise ValueError(msg)


def packed_order(document_ids_BS: torch.Tensor, cp: int) -> torch.Tensor:
    """(B, S): the row positions of every rank's tokens, rank-major (the order of the K/V all-gather); rank r's are
    ``[:, r·s:(r+1)·s]``, in row order (chunk r, then chunk 2·cp-1-r, of each document in turn)."""
    o_BS, n_BS = _document_extent(document_ids_BS)
    chunk_BS = o_BS // torch.clamp(n_BS // (2 * cp), min=1)
    owner_BS = torch.minimum(chunk_BS, 2 * cp - 1 - chunk_BS)
    return torch.argsort(owner_BS, dim=1, stable=True)  # a stable sort keeps each rank's tokens in row order


def packed_zigzag_index(document_ids_BS: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """(B, S / cp): the row positions of ``rank``'s tokens, in row order."""
    s = document_ids_BS.shape[1] // cp
    return packed_order(document_ids_BS, cp)[:, rank * s:(rank + 1) * s]


def packed_cp_tokens(document_ids_BS: torch.Tensor, cp: int, rank: int) -> tuple[torch.Tensor, ...]:
    """The queries and keys of ``rank``'s attention: its row positions (B, s) and their document ids, and every
    rank's row positions (B, S) in rank-major order and their document ids. A query may attend to a key of the same
    document at or before its row position (both forms of ``document_mask.py`` read this)."""
    s = document_ids_BS.shape[1] // cp
    keys_BS = packed_order(document_ids_BS, cp)
    mine_Bs = keys_BS[:, rank * s:(rank + 1) * s]
    return mine_Bs, document_ids_BS.gather(1, mine_Bs), keys_BS, document_ids_BS.gather(1, keys_BS)


def packed_cp_mask(document_ids_BS: torch.Tensor, cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's row positions (B, s); the mask (B, 1, s, S) of its queries over every rank's keys in rank-major
    order, True where a query may attend: same document, key at or before the query)."""
    mine_Bs, doc_q_Bs, keys_BS, doc_k_BS = packed_cp_tokens(document_ids_BS, cp, rank)
    mask_BsS = (doc_q_Bs.unsqueeze(2) == doc_k_BS.unsqueeze(1)) & (keys_BS.unsqueeze(1) <= mine_Bs.unsqueeze(2))
    return mine_Bs, mask_BsS.unsqueeze(1)
