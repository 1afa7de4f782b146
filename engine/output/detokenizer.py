"""Incremental detokenization and stop strings for one generated sequence.

Decoding token by token is wrong for byte-level BPE and SentencePiece: one character may
span several tokens, and SentencePiece decoders drop a leading space at the start of the
text they are given. So the text is decoded over a small sliding window of token ids and
the new text is the difference between two decodes of that window::

    ids:  ... prompt tail ... | out0 out1 out2 | out3 out4
                              ^prefix_offset   ^read_offset
    prefix_text = decode(ids[prefix_offset:read_offset])   (already emitted)
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]  unless new_text ends with U+FFFD
                                               (a character still incomplete: wait)

Both decodes start at the same token, so whatever the decoder does at the start of its
input cancels out. The window starts in the prompt's last tokens, so the first output token
decodes in context (a SentencePiece "▁Hello" after a prompt is " Hello"). Each update
decodes only the window: O(new tokens), not O(output).

Stop strings are searched in the newly decoded text plus the last (longest stop - 1)
characters before it, so a stop string split over several tokens is found, and one in the
prompt never is. The earliest match in the text wins. While the text's tail could still
become a stop string it is held back from `get_delta`; that tail is found by comparing
against the stop strings in place, so a detokenizer keeps O(longest stop) characters of its
own, and the stop strings themselves are the request's (shared by its samples).
"""

from __future__ import annotations

from engine.output.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams

# Prompt tokens the first window starts with (vLLM uses the same number).
_PROMPT_CONTEXT_TOKENS = 5
# When the prompt tail starts inside a multi-byte character, step back this far at most.
_PROMPT_CONTEXT_EXTRA = 6
# Token ids before the window are dropped once this many have piled up.
_TRIM_THRESHOLD = 256

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, watching for stop strings.

    The caller feeds each step's new ids to `update`, reads streaming text with
    `get_delta`, and calls `flush` when the request ends for another reason (EOS, length,
    abort) to release text still held back.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        # The request's own strings (shared by its samples, never copied per sample).
        self.stop: tuple[str, ...] = tuple(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # The stop string that ended the text, if any.
        self.stop_reason: str | None = None
        # True after a stop string matched or `flush` was called: no more text will come.
        self.finished = False

        max_stop = max((len(s) for s in self.stop), default=0)
        self._tail_len = max(max_stop - 1, 0)
        self._tail = ""  # the last _tail_len chars of the text, for matches across updates
        self._hold_for_stops = bool(self.stop) and not self.include_stop_str_in_output

        # Decoding window (see the module docstring).
        self._ids, self._prefix_text = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

        # Text so far as pieces (joined lazily), and the pieces get_delta has not returned.
        self._pieces: list[str] = []
        self._text_len = 0
        self._joined: str | None = ""
        self._unsent: list[str] = []
        self._sent_len = 0

    # ---- public API -----------------------------------------------------------------------

    @property
    def output_text(self) -> str:
        """Text so far, cut at a matched stop string (which is kept only if
        include_stop_str_in_output). Characters still incomplete are not included."""
        if self._joined is None:
            self._joined = "".join(self._pieces)
            self._pieces = [self._joined]
        return self._joined

    def update(self, new_token_ids: list[int]) -> str | None:
        """Appends generated ids; returns the stop string if one just completed.

        After a stop string (or `flush`) further ids are recorded but add no text.
        """
        self.token_ids.extend(new_token_ids)
        if self.finished or not new_token_ids:
            return None
        self._ids.extend(new_token_ids)
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT):
            return None  # nothing yet, or a multi-byte character still incomplete
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._trim_window()
        return self._append_text(delta)

    def flush(self) -> str | None:
        """Ends the sequence: text held back for an incomplete character is released as is
        (with U+FFFD, as `decode` would render it), and `get_delta` returns everything left.

        Returns a stop string if the released text completed one (the text is cut there).
        """
        if self.finished:
            return None
        stop = None
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(self._prefix_text):
            stop = self._append_text(new_text[len(self._prefix_text) :])
        self.finished = True
        return stop

    def get_delta(self) -> str:
        """Text not returned by earlier calls, for streaming.

        Never ends inside a multi-byte character, and while the text could still end in a
        stop string that will be cut off, that tail (at most longest stop - 1 chars) is held
        back until the next tokens resolve it, or until the sequence finishes.
        """
        if not self._unsent:
            return ""
        pending = "".join(self._unsent)
        hold = 0 if self.finished or not self._hold_for_stops else self._stop_prefix_len(pending)
        delta = pending[: len(pending) - hold]
        self._unsent = [pending[len(delta) :]] if hold else []
        self._sent_len += len(delta)
        return delta

    # ---- internals ------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def _prompt_context(self, prompt_token_ids: list[int]) -> tuple[list[int], str]:
        """The prompt's last few ids and their text, stepping back if they start inside a
        character (a window starting mid-character would decode differently as it grows)."""
        start = max(len(prompt_token_ids) - _PROMPT_CONTEXT_TOKENS, 0)
        first: tuple[list[int], str] | None = None
        for cand in range(start, max(start - _PROMPT_CONTEXT_EXTRA, 0) - 1, -1):
            ids = list(prompt_token_ids[cand:])
            text = self._decode(ids)
            if not text.startswith(_REPLACEMENT):
                return ids, text
            first = first or (ids, text)
        assert first is not None
        return first

    def _trim_window(self) -> None:
        if self._prefix_offset >= _TRIM_THRESHOLD:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _append_text(self, text: str) -> str | None:
        """Adds decoded text, cutting it at the first stop string it completes."""
        region = self._tail + text
        match = self._find_stop(region) if len(self.token_ids) > self.min_tokens else None
        if match is not None:
            stop, start = match
            end = start + (len(stop) if self.include_stop_str_in_output else 0)
            # Offsets in `region` -> offsets in the new `text` (a match may start in the tail).
            keep_new = end - len(self._tail)
            if keep_new < 0:
                self._truncate(self._text_len + keep_new)
            else:
                self._push(text[:keep_new])
            self.stop_reason = stop
            self.finished = True
            return stop
        self._push(text)
        if self._tail_len:
            self._tail = region[-self._tail_len :]
        return None

    def _find_stop(self, region: str) -> tuple[str, int] | None:
        """(stop string, start in region) of the match that completes first.

        Same end: the longer stop string wins (it removes more of the text).
        """
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            # Only matches that end in the new text: older ones were checked (or ignored
            # under min_tokens) when their text arrived.
            start = region.find(stop, max(len(self._tail) - len(stop) + 1, 0))
            if start < 0:
                continue
            key = (start + len(stop), -len(stop), stop)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return stop, end + neg_len

    def _push(self, text: str) -> None:
        if not text:
            return
        self._pieces.append(text)
        self._unsent.append(text)
        self._text_len += len(text)
        self._joined = None

    def _truncate(self, length: int) -> None:
        """Cuts the text to `length` chars (a stop string that began in an earlier update).

        Text past `length` was never streamed: get_delta holds back any tail that could
        still become a stop string.
        """
        full = self.output_text[:length]
        self._pieces = [full]
        self._joined = full
        self._text_len = length
        pending = "".join(self._unsent)[: max(length - self._sent_len, 0)]
        self._unsent = [pending] if pending else []

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string.

        Compares in place, so memory is the stop strings themselves: for each one, the
        tails that could match start at an occurrence of its first character, and the
        longest that does is the first found scanning from the left.
        """
        best = 0
        for stop in self.stop:
            # Tail lengths k in (best, len(stop) - 1]: starts in [len - len(stop) + 1, len - best).
            end = len(text) - best
            pos = text.find(stop[0], max(len(text) - len(stop) + 1, 0), end)
            while pos >= 0:
                if stop.startswith(text[pos:]):
                    best = len(text) - pos
                    break
                pos = text.find(stop[0], pos + 1, end)
        return best
