"""Packed documents: cu_seqlens validation and per-token document ids."""

from __future__ import annotations

import torch

from flash_msa.layout import check_not_meta


def check_cu_seqlens(
    cu_seqlens: torch.Tensor,
    total_tokens: int | None = None,
    max_seqlen: int | None = None,
    device: torch.device | None = None,
) -> None:
    """cu_seqlens int32 [N + 1]: starts at 0, non-decreasing, ends at total_tokens (when
    given), longest document <= max_seqlen (when given). ValueError/TypeError otherwise."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}; use .int()")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D [num_documents + 1] with at least 2 entries, got shape "
            f"{list(cu_seqlens.shape)}"
        )
    if device is not None and cu_seqlens.device != device:
        raise ValueError(
            f"cu_seqlens is on {cu_seqlens.device} but the tensors on {device}; move it there"
        )
    check_not_meta("cu_seqlens", cu_seqlens.device)
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {first}")
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if bool((lengths < 0).any()):
        document = int((lengths < 0).nonzero()[0, 0])
        raise ValueError(
            f"cu_seqlens must be non-decreasing: document {document} has length "
            f"{int(lengths[document])}"
        )
    if total_tokens is not None and last != total_tokens:
        raise ValueError(
            f"cu_seqlens must end at the number of packed tokens {total_tokens}, got {last}"
        )
    if max_seqlen is not None and int(lengths.max()) > max_seqlen:
        raise ValueError(
            f"max_seqlen {max_seqlen} is shorter than the longest document "
            f"({int(lengths.max())} tokens); pass max_seqlen >= it"
        )


def document_ids_of(cu_seqlens: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """int32 [T]: the document of each packed token (empty documents own no token), from
    cu_seqlens int32 [N + 1], checked (starts at 0, non-decreasing) unless check is False
    (callers that checked it already)."""
    if check:
        check_cu_seqlens(cu_seqlens)
    total = int(cu_seqlens[-1])
    positions = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    boundaries = cu_seqlens.contiguous()  # a strided view works, but searchsorted warns
    return (torch.searchsorted(boundaries, positions, right=True) - 1).int()


def document_ids_of_starts(starts: torch.Tensor) -> torch.Tensor:
    """int32 [..., S]: document ids numbered from 0 in each row, from bool starts [..., S - 1]
    (True where token t + 1 begins a new document)."""
    zeros = torch.zeros_like(starts[..., :1])
    return torch.cat([zeros, starts], dim=-1).cumsum(-1).int()


def document_begins(document_ids: torch.Tensor) -> torch.Tensor:
    """bool [..., S]: where a document begins in document_ids [..., S] (non-decreasing along
    S), the first token of every row included."""
    begins = torch.ones_like(document_ids, dtype=torch.bool)
    begins[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    return begins


def document_first_tokens(document_ids: torch.Tensor) -> torch.Tensor:
    """int64 [..., S]: the position of the first token of each token's document."""
    positions = torch.arange(document_ids.shape[-1], device=document_ids.device)
    return torch.where(document_begins(document_ids), positions, 0).cummax(dim=-1).values


def cu_seqlens_of(document_ids: torch.Tensor) -> torch.Tensor:
    """int32 [N + 1]: the documents of document_ids [B, S] with its rows one after another
    (every row starts a document): document_ids_of's inverse."""
    bounds = document_begins(document_ids).flatten().nonzero().flatten()
    return torch.cat([bounds, bounds.new_tensor([document_ids.numel()])]).int()


def check_document_ids(document_ids: torch.Tensor, batch: int, seq_len: int, device) -> None:
    """document_ids int [B, S], non-decreasing along S (documents are contiguous)."""
    if not isinstance(document_ids, torch.Tensor):
        raise TypeError(f"document_ids must be a torch.Tensor, got {type(document_ids).__name__}")
    if document_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"document_ids must be int32 or int64, got {document_ids.dtype}")
    if tuple(document_ids.shape) != (batch, seq_len):
        raise ValueError(
            f"document_ids must be [batch, seq_len] = [{batch}, {seq_len}], got "
            f"{list(document_ids.shape)}"
        )
    if document_ids.device != device:
        raise ValueError(
            f"document_ids is on {document_ids.device} but the tensors on {device}; move it"
        )
    check_not_meta("document_ids", document_ids.device)
    int32 = torch.iinfo(torch.int32)  # the kernels read the ids as int32
    flags = [
        (document_ids[:, 1:] < document_ids[:, :-1]).any(),
        ((document_ids < int32.min) | (document_ids > int32.max)).any(),
    ]
    decreasing, out_of_range = torch.stack(flags).tolist()  # one read from the device
    if decreasing:
        raise ValueError(
            "document_ids must be non-decreasing along the sequence (each document one "
            "contiguous run of tokens)"
        )
    if out_of_range:
        raise ValueError(
            f"document_ids must lie in int32's range [{int32.min}, {int32.max}] (the kernels "
            "read them as int32, where larger ids would merge documents): number the "
            "documents 0, 1, 2, ..."
        )
