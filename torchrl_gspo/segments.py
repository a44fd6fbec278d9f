# Copyright (c) torchrl_gspo contributors.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
"""Segments of responses: which subsequence each valid token belongs to, and sums over them.

Every function works on the loss' ``[B, T]`` layout (left-padded, a loss mask with
possible holes) with cumulative sums and scatters: no Python loop over rows or
segments. :math:`K` equal segments are given by their bounds, ``[B, K + 1]``, and
their sums are ``[B, K]``; the other ways give a segment index, ``[B, T]``, counting
a row's segments from 0 on its valid tokens (and 0 off the mask, where no value is
summed), and their sums are ``[B, T]``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = [
    "bounded_sums",
    "delimiter_segments",
    "delimiter_token_ids",
    "equal_bounds",
    "id_segments",
    "segment_sums",
]

DELIMITERS = ".,;:!?\n"


def equal_bounds(lengths: torch.Tensor, count: int) -> torch.Tensor:
    r"""Where ``count`` nearly equal segments of each row's valid tokens start and end.

    With :math:`n` valid tokens, the first :math:`n \bmod K` segments hold
    :math:`\lceil n / K \rceil` tokens and the others :math:`\lfloor n / K \rfloor`;
    a row with fewer than :math:`K` tokens has one token per segment (and empty ones).

    Args:
        lengths (torch.Tensor): ``[B]`` each row's valid tokens :math:`n`.
        count (int): :math:`K \ge 1`.

    Returns:
        torch.Tensor: ``[B, K + 1]`` the number of valid tokens before each segment,
        and :math:`n` last.

    Examples:
        >>> import torch
        >>> from torchrl_gspo.segments import equal_bounds
        >>> equal_bounds(torch.tensor([5, 1]), 2)  # 5 tokens: 3 then 2; 1 token: 1 then 0
        tensor([[0, 3, 5],
                [0, 1, 1]])
    """
    n = lengths.unsqueeze(-1)
    k = torch.arange(count + 1, device=lengths.device)
    return k * (n // count) + torch.minimum(k, n % count)


def bounded_sums(values: torch.Tensor, mask: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` the sum of ``values`` over the valid tokens of each segment.

    The segments are given by their bounds (:func:`~torchrl_gspo.segments.equal_bounds`);
    each sum is a difference of a cumulative sum, read at the bounds.

    Args:
        values (torch.Tensor): ``[B, T]``, 0 off the mask.
        mask (torch.Tensor): ``[B, T]`` the loss mask.
        bounds (torch.Tensor): ``[B, K + 1]`` valid tokens before each segment.

    Returns:
        torch.Tensor: ``[B, K]``.

    Examples:
        >>> import torch
        >>> from torchrl_gspo.segments import bounded_sums, equal_bounds
        >>> values = torch.tensor([[0.0, 1.0, 2.0, 0.0, 4.0]])
        >>> mask = torch.tensor([[False, True, True, False, True]])  # a hole
        >>> bounded_sums(values, mask, equal_bounds(mask.sum(-1), 2))
        tensor([[3., 4.]])
    """
    seen = mask.cumsum(-1, dtype=torch.int32)  # valid tokens up to each position
    # the position of the b-th valid token, whose prefix sum holds the first b
    last = torch.searchsorted(seen, bounds.to(torch.int32))
    last = last.clamp(max=values.shape[-1] - 1)
    prefix = torch.where(bounds > 0, values.cumsum(-1).gather(-1, last), 0.0)
    return prefix[..., 1:] - prefix[..., :-1]


def delimiter_segments(mask: torch.Tensor, tokens: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Segments that end after each valid token whose id is in ``ids``.

    A delimiter off the mask ends nothing; a delimiter as a row's last valid token
    opens no empty segment.

    Args:
        mask (torch.Tensor): ``[B, T]`` the loss mask.
        tokens (torch.Tensor): ``[B, T]`` the token ids, aligned with ``mask``.
        ids (torch.Tensor): ``[D]`` the delimiter ids.

    Returns:
        torch.Tensor: ``[B, T]`` the segment index of each valid token.

    Examples:
        >>> import torch
        >>> from torchrl_gspo.segments import delimiter_segments
        >>> tokens = torch.tensor([[4, 9, 5, 9, 9, 6]])  # 9 ends a segment
        >>> mask = torch.ones_like(tokens, dtype=torch.bool)
        >>> delimiter_segments(mask, tokens, torch.tensor([9]))
        tensor([[0, 0, 1, 1, 2, 3]])
    """
    ends = torch.isin(tokens, ids.to(tokens.device)) & mask
    before = ends.cumsum(-1) - ends.long()  # the delimiters strictly before each token
    return torch.where(mask, before, 0)


def id_segments(mask: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Segments given by a per-token segment id: a new one where the id changes.

    Ids on masked positions are ignored; along a row's valid tokens they must not
    decrease.

    Args:
        mask (torch.Tensor): ``[B, T]`` the loss mask.
        ids (torch.Tensor): ``[B, T]`` integer segment ids, aligned with ``mask``.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``[B, T]`` the segment index of each
        valid token, and ``[B]`` the rows where the ids decrease.

    Examples:
        >>> import torch
        >>> from torchrl_gspo.segments import id_segments
        >>> ids = torch.tensor([[0, 3, 3, 7, 0, 7]])  # the masked 0 is ignored
        >>> mask = torch.tensor([[False, True, True, True, False, True]])
        >>> index, decreasing = id_segments(mask, ids)
        >>> index[mask], decreasing
        (tensor([0, 0, 1, 1]), tensor([False]))
    """
    lowest = torch.iinfo(ids.dtype).min
    ids = torch.where(mask, ids, lowest)
    highest = ids.cummax(-1).values  # the largest valid id so far (itself included)
    decreasing = (mask & (ids < highest)).any(-1)
    previous = torch.cat([torch.full_like(highest[:, :1], lowest), highest[:, :-1]], -1)
    first = mask.cumsum(-1) == 1
    starts = mask & ((ids != previous) | first)
    return torch.where(mask, starts.cumsum(-1) - 1, 0), decreasing


def segment_sums(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` the sum of ``values`` over each segment (0 past a row's last one).

    Args:
        values (torch.Tensor): ``[B, T]``, 0 off the mask.
        index (torch.Tensor): ``[B, T]`` a segment index.

    Returns:
        torch.Tensor: ``[B, T]``, entry :math:`k` of a row the sum over its segment
        :math:`k`.
    """
    return torch.zeros_like(values).scatter_add(-1, index, values)


def delimiter_token_ids(tokenizer, characters: Iterable[str] = DELIMITERS) -> list[int]:
    """The ids whose decoded text ends with one of ``characters``.

    Args:
        tokenizer: a Hugging Face tokenizer (``len`` and ``decode``).
        characters (Iterable[str], optional): the characters that end a segment.
            Defaults to ``.,;:!?`` and newline.

    Returns:
        list[int]: the ids, in increasing order.

    Examples:
        >>> from tokenizers import Tokenizer, models
        >>> from transformers import PreTrainedTokenizerFast
        >>> from torchrl_gspo.segments import delimiter_token_ids
        >>> words = models.WordLevel({"a": 0, "b.": 1, "?": 2, "c": 3}, unk_token="a")
        >>> delimiter_token_ids(PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words)))
        [1, 2]
    """
    ends = tuple(characters)
    if not ends or not all(isinstance(c, str) and c for c in ends):
        raise ValueError(f"characters must be non-empty strings, got {characters!r}.")
    return [i for i in range(len(tokenizer)) if tokenizer.decode([i]).endswith(ends)]
