"""Incremental detokenisation with stop strings: the text of a request as its tokens arrive.

Decoding the whole output every step is quadratic in its length. :class:`TextStream` decodes a
short window instead (the vLLM / TGI method): the tokens from ``prefix_offset`` (a few already
emitted tokens, so a tokenizer that treats the first token of a string specially, such as
SentencePiece's leading-space rule, sees the same first token twice) to the end, minus the
decoded window up to ``read_offset``. Text ending in U+FFFD (an incomplete UTF-8 character split
over byte tokens) is held back until the character completes.

Stop strings are searched only where a new one can appear: the new text plus the last
``len(stop) - 1`` characters before it. While a request runs, the last ``max(len(stop)) - 1``
characters are held back from the stream, so a stop string split over two steps never reaches
a client; the final text is cut before the first stop string.

Worked example (byte-level BPE, no stop strings)::

    tokens  "Hel" "lo" " wor" "ld"      emitted text per add(): "Hel", "lo", " wor", "ld"
"""

from __future__ import annotations


class TextStream:
    """The text of one request's new tokens, built incrementally.

    Args:
        tokenizer: a transformers tokenizer (``decode``).
        stop: stop strings (non-empty).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tok = tokenizer
        self.stop = tuple(stop)
        self.hold = (
            max((len(s) for s in self.stop), default=1) - 1
        )  # characters held back while running
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start (already decoded tokens kept for context)
        self.read_offset = 0  # tokens whose text is in self.text
        self.text = ""  # decoded text so far (complete characters only)
        self.sent = 0  # characters of self.text already returned
        self.stopped = False
        self._backend = backend_decoder(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; returns the text that may be streamed now (possibly empty). After a
        stop string appears, :attr:`stopped` is True and nothing more is returned."""
        if self.stopped or not new_ids:
            return ""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            before = len(self.text)
            self.text += delta
            if self.stop:
                start = max(before - self.hold, 0)
                cuts = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
                if cuts:
                    self.text = self.text[: min(cuts)]
                    self.stopped = True
                    return self._take(len(self.text))
        return self._take(max(len(self.text) - self.hold, self.sent))

    def finish(self) -> str:
        """The rest of the text (held-back characters; an incomplete final character as the
        tokenizer decodes it) when the request ends."""
        if not self.stopped and self.read_offset < len(self.ids):
            self.text += self._decode(self.ids[self.prefix_offset :])[
                len(self._decode(self.ids[self.prefix_offset : self.read_offset])) :
            ]
            self.read_offset = len(self.ids)
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        out = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return out


def backend_decoder(tokenizer):
    """The ``tokenizers.Tokenizer`` under a transformers fast tokenizer whose ``decode`` is
    transformers' own (then ``decode(ids, skip_special_tokens=True,
    clean_up_tokenization_spaces=False)`` is exactly ``backend.decode(ids, skip_special_tokens=
    True)``: ``TokenizersBackend._decode``), else None. Calling it directly skips transformers'
    argument conversion: 0.96 us a call instead of 3.24 (the default target's tokenizer, a
    6-token window, a small CPU), two calls per row and step, so a 64-row plain step's host time
    went from 1.11-1.14 to 0.84-0.89 ms (``redraft-bench --overhead --overhead-batches 8,64``,
    tiny target, two runs each, alternating)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its own decode
        return None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and cls._decode is TokenizersBackend._decode
        and cls.decode is PreTrainedTokenizerBase.decode
        and hasattr(backend, "decode")
    ):
        return backend
    return None


class NoText:
    """A :class:`TextStream` that decodes nothing: an engine whose callers read only token ids
    (``Engine(text=False)``: distillation) skips the two tokenizer calls per row and step that
    incremental detokenisation costs (tiny target, 40 rows: host time per step
    0.80-0.88 -> 0.46-0.63 ms on a small CPU). No stop strings: they need the text."""

    text = ""
    stopped = False

    def add(self, new_ids: list[int]) -> str:
        return ""

    def finish(self) -> str:
        return ""
