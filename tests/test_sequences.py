"""flash_msa.sequences.document_ids_of: the document of each packed token, from checked
cu_seqlens."""

import pytest
import torch

from flash_msa.sequences import document_ids_of


def test_document_ids_of_packed_documents():
    """Empty documents own no token; the ids count every document, empty ones included."""
    cu_seqlens = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    assert document_ids_of(cu_seqlens).tolist() == [0, 0, 2, 2, 2]


@pytest.mark.parametrize(
    "cu_seqlens, error, message",
    [
        ([0, 5], TypeError, "cu_seqlens must be a torch.Tensor, got list"),
        (torch.tensor([0, 5]), TypeError, "cu_seqlens must be int32, got torch.int64"),
        (torch.tensor(5, dtype=torch.int32), ValueError, r"must be 1-D \[num_documents \+ 1\]"),
        (torch.tensor([2, 5], dtype=torch.int32), ValueError, "cu_seqlens must start at 0, got 2"),
        (torch.tensor([0, 5, 3], dtype=torch.int32), ValueError,
         "cu_seqlens must be non-decreasing: document 1 has length -2"),
    ],
    ids=["list", "int64", "0-d", "start", "decreasing"],
)  # fmt: skip
def test_document_ids_of_refuses_bad_cu_seqlens(cu_seqlens, error, message):
    with pytest.raises(error, match=message):
        document_ids_of(cu_seqlens)
