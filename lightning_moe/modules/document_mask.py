"""The attention mask of packed documents (``TokenDataModule(pack_documents=True)``), built once per micro-batch for
all layers, and attention under it. A query attends to the keys of its own document at or before its row position.

The rule comes in two forms:

* ``dense``: a (B, 1, s, S) boolean tensor for masked SDPA. It needs O(S²) memory (1 GiB per row at 32k tokens). This
  is the CPU path and the reference.
* ``flex``: a FlexAttention ``BlockMask``, which holds the rule as a ``mask_mod`` over each row's document ids and row
  positions, plus which (query, key) blocks of 128 x 128 are empty, full or partial. It needs O(S²/128²) memory and
  ``flex_attention`` skips the empty blocks. On CUDA both the mask and the attention are compiled (Triton kernels,
  no host sync); GQA's kv heads are not repeated, and MLA's value head dim may be below q/k's.

Under packed context parallelism (``packed_context_parallel.py``) the queries are this rank's tokens and the keys are
every rank's, in rank-major order (the K/V all-gather's). Both forms read each token's document and row position
from ``packed_cp_tokens``, so they allow the same pairs.

Shapes: B rows, S keys (the row), s queries (S / cp), H query heads, G kv heads, E q/k head dim, F v head dim.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from lightning_moe.modules.config import DOCUMENT_ATTENTION
from lightning_moe.modules.packed_context_parallel import packed_cp_mask, packed_cp_tokens

BLOCK_SIZE = 128  # FlexAttention's default sparse block (query rows x key columns)
Mask = Union[torch.Tensor, BlockMask]

_COMPILED: dict = {}  # a cache of compiled functions (not parallel state)


def _compiled(fn):
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


def use_flex(mode: str, device: torch.device) -> bool:
    """Whether ``ModelConfig.document_attention`` picks the BlockMask: ``auto`` on CUDA, ``flex`` everywhere. On CPU
    flex runs eagerly and only without gradients (torch has no CPU backward for it)."""
    if mode not in DOCUMENT_ATTENTION:
        raise ValueError(f"document_attention={mode!r}: choose from {DOCUMENT_ATTENTION}")
    return device.type == "cuda" if mode == "auto" else mode == "flex"


def document_mask(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """(B, 1, S, S), True where query i may attend to key j: j <= i within the same document."""
    S = document_ids_BS.shape[1]
    causal_SS = torch.ones(S, S, dtype=torch.bool, device=document_ids_BS.device).tril()
    same_BSS = document_ids_BS.unsqueeze(2) == document_ids_BS.unsqueeze(1)
    return (same_BSS & causal_SS).unsqueeze(1)


# the mask_mods are made by module-level functions: a compiled caller then sees one code object for every micro-batch
# and takes the tensors they close over as inputs (no recompilation per batch)
def _row_mask_mod(doc_BS: torch.Tensor):
    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_BS[b, q_idx] == doc_BS[b, kv_idx]) & (kv_idx <= q_idx)
    return mask_mod


def _cp_mask_mod(row_q_Bs: torch.Tensor, doc_q_Bs: torch.Tensor, row_k_BS: torch.Tensor, doc_k_BS: torch.Tensor):
    def mask_mod(b, h, q_idx, kv_idx):  # packed_cp_mask's rule, one (query, key) pair at a time
        return (doc_q_Bs[b, q_idx] == doc_k_BS[b, kv_idx]) & (row_k_BS[b, kv_idx] <= row_q_Bs[b, q_idx])
    return mask_mod


def build_document_mask(document_ids_BS: torch.Tensor, cp: int = 1, cp_rank: int = 0, flex: bool = False,
                        block_size: int = BLOCK_SIZE) -> tuple[Optional[torch.Tensor], Mask]:
    """(this rank's row positions (B, s), None without CP; the mask of its queries over the keys: a (B, 1, s, S)
    boolean tensor, or with ``flex`` a BlockMask of the same pairs)."""
    B, S = document_ids_BS.shape
    if not flex:
        return packed_cp_mask(document_ids_BS, cp, cp_rank) if cp > 1 else (None, document_mask(document_ids_BS))
    if cp > 1:
        mine_Bs, *tokens = packed_cp_tokens(document_ids_BS, cp, cp_rank)
        mask_mod, q_len = _cp_mask_mod(mine_Bs, *tokens), S // cp
    else:
        mine_Bs, mask_mod, q_len = None, _row_mask_mod(document_ids_BS), S
    dev = document_ids_BS.device
    # compiled on CUDA: eagerly, create_block_mask materialises the whole (B, s, S) mask first
    make = _compiled(create_block_mask) if dev.type == "cuda" else create_block_mask
    return mine_Bs, make(mask_mod, B, None, q_len, S, device=dev, BLOCK_SIZE=block_size)


def document_attention(q_BHsE: torch.Tensor, k_BGSE: torch.Tensor, v_BGSF: torch.Tensor, mask: Mask,
                       scale: Optional[float] = None) -> torch.Tensor:
    """Attention of the queries over the keys (q/k already rotated) under a mask of ``build_document_mask``."""
    H, G = q_BHsE.shape[1], k_BGSE.shape[1]
    if isinstance(mask, BlockMask):
        # flex takes F != E (MLA: 128 vs 192) and G < H (enable_gqa) as they are: no padding, no repeated K/V
        flex = _compiled(flex_attention) if q_BHsE.is_cuda else flex_attention
        return flex(q_BHsE, k_BGSE, v_BGSF, block_mask=mask, scale=scale, enable_gqa=G != H)
    if G != H and q_BHsE.is_cuda:  # CUDA's masked (memory-efficient) kernel takes no GQA: K/V to every head
        k_BGSE, v_BGSF = k_BGSE.repeat_interleave(H // G, 1), v_BGSF.repeat_interleave(H // G, 1)
    return F.scaled_dot_product_attention(q_BHsE, k_BGSE, v_BGSF, attn_mask=mask, scale=scale,
                                          enable_gqa=k_BGSE.shape[1] != H)
