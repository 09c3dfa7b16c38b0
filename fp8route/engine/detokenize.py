"""Token ids to text as they stream: what each step adds that can be sent now, cut at a stop string.

A byte-level tokenizer can split one character over several tokens: a window that ends inside one
decodes to a trailing U+FFFD, so that text waits until the character is complete (or the stream
ends). Each window is decoded after the tokens before it, because some decoders (SentencePiece's
metaspace) drop the leading space of whatever they decode first. Stop strings are found in the
text, wherever the token boundaries fall; text that could still grow into one waits too, and
neither the stop string nor anything after it is ever returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token, as vLLM's detokenizer does


class TextStream:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (), stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        if self._decode(self.ids).endswith(REPLACEMENT):
            self.ids = []  # a prompt ending inside a character: its completion belongs to the output
        self.prefix = 0  # ids[prefix:read]: context already turned into text
        self.read = len(self.ids)
        self.stop = [s for s in stop if s]
        self.text = ""  # the output's text so far, cut at a stop string once one is found
        self.sent = 0  # characters of text already returned
        self.stop_reason: str | None = None  # the stop string that ended the text

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        """The text these new tokens let out now; final: no more tokens will come, hold nothing back."""
        if self.stop_reason is not None:
            return ""
        self.ids += token_ids
        self.text += self._advance(final)
        return self._release(final)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if ids else ""

    def _advance(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def _release(self, final: bool) -> str:
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, self.sent)) >= 0]
        if hits:
            end, self.stop_reason = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
            self.text = self.text[:end]
        else:
            end = len(self.text) if final else len(self.text) - self._held()
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def _held(self) -> int:
        """How many trailing characters could be the start of a stop string."""
        longest = max((len(s) for s in self.stop), default=1) - 1
        for n in range(min(longest, len(self.text) - self.sent), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
