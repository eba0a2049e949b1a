"""The responses that `previous_response_id` continues from: each stored response's
conversation (the chat messages it was generated from, its own instructions left out, and its
answer as the last assistant turn), kept in memory by the http process.

Bounded two ways, least recently used first out: at most `max_responses` responses and
`max_chars` characters of stored messages (JSON text) in all. A response asked with
`store: false`, one that failed, and one evicted are not found: its id is a 404. Nothing
survives a restart, and each replica of a --dp server keeps its own.
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from typing import Any

MAX_RESPONSES = 1024
MAX_CHARS = 64 << 20  # ~64 MB of conversation text; one response larger than this is not kept


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS):
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._entries: OrderedDict[str, tuple[list[dict[str, Any]], int]] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        size = len(json.dumps(messages, ensure_ascii=False))
        self.pop(response_id)
        if size > self.max_chars:
            return
        self._entries[response_id] = (messages, size)
        self._chars += size
        while len(self._entries) > self.max_responses or self._chars > self.max_chars:
            self._evict_oldest()

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        """A copy of the stored conversation (the caller extends it); None if not kept."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)  # a conversation still going stays longest
        return copy.deepcopy(entry[0])

    def pop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._chars -= entry[1]
        return entry is not None

    def _evict_oldest(self) -> None:
        _, (_, size) = self._entries.popitem(last=False)
        self._chars -= size
