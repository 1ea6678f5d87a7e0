"""Packing tokenized documents into fixed training windows.

Documents ``[bos, t_1, ..., t_n, eos]`` are concatenated into one stream that is cut into
non-overlapping windows ``w`` of ``seq_len + 1`` tokens. Each window gives

    input[t]   = w[t]                                     t = 0 .. seq_len - 1
    labels[t]  = w[t + 1], or IGNORE_INDEX if w[t + 1] starts a document (or is padding)
    doc_ids[t] = number of document starts in w[1 .. t]   (0 for the window's first document)

``doc_ids`` lets the model reset KDA state and mask MLA attention at document starts; a
document cut by a window boundary simply continues as document 0 of the next window. The label
at a document's last token (``eos`` predicting the next ``bos``) is ignored: nothing in the
finished document can inform the next one, and ``bos`` is inserted by the pipeline anyway.
"""

from collections import deque
from typing import Any

import torch

IGNORE_INDEX = -100


def window_sample(
    tokens: torch.Tensor, starts: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input, labels, doc_ids)`` of one window.

    tokens: [seq_len + 1] int64; starts: [seq_len + 1] bool, True where a document begins;
    valid: [seq_len + 1] bool, False on padding.
    """
    labels = tokens[1:].clone()
    labels[starts[1:] | ~valid[1:]] = IGNORE_INDEX
    new_doc = starts[:-1].clone()
    new_doc[0] = False
    doc_ids = torch.cumsum(new_doc, 0, dtype=torch.int32)
    return tokens[:-1].clone(), labels, doc_ids


class DocumentPacker:
    """A FIFO token buffer that hands out ``window``-token pieces of the document stream.

    Popped tokens are dropped lazily (a read offset, compacted once it passes half the buffer),
    so a document much longer than a window is cut in linear time.
    """

    def __init__(self, window: int):
        self.window = window
        self._tokens: list[int] = []
        self._starts: deque[int] = deque()
        self._head = 0

    def add(self, document: list[int]) -> None:
        self._starts.append(len(self._tokens))
        self._tokens.extend(document)

    def __len__(self) -> int:
        return len(self._tokens) - self._head

    def ready(self) -> bool:
        return len(self) >= self.window

    def pop(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next full window as ``(tokens, starts, valid)``; requires ``ready()``."""
        head, n = self._head, self.window
        tokens = torch.tensor(self._tokens[head : head + n], dtype=torch.int64)
        starts = torch.zeros(n, dtype=torch.bool)
        while self._starts and self._starts[0] < head + n:
            starts[self._starts.popleft() - head] = True
        self._head += n
        if 2 * self._head > len(self._tokens):
            self._compact()
        return tokens, starts, torch.ones(n, dtype=torch.bool)

    def pop_padded(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The partial last window of a finite stream, padded; requires a non-empty buffer.

        The padding counts as a new document, so no real token shares a doc_id with it.
        """
        n_real = len(self)
        self.add([pad_id] * (self.window - n_real))
        tokens, starts, valid = self.pop()
        valid[n_real:] = False
        return tokens, starts, valid

    def _compact(self) -> None:
        self._tokens = self._tokens[self._head :]
        self._starts = deque(s - self._head for s in self._starts)
        self._head = 0

    def state_dict(self) -> dict[str, Any]:
        self._compact()
        return {"tokens": list(self._tokens), "starts": list(self._starts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._tokens = list(state["tokens"])
        self._starts = deque(state["starts"])
        self._head = 0
