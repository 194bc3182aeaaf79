"""Where a low-precision speculative output first differs from plain greedy decoding, and why.

In float32 the speculative decoder reproduces plain greedy decoding token for token. In bfloat16
(and float16) a batched verify forward rounds differently from a one-token step, so where the
target's two best next tokens are within rounding of each other the argmax can flip, and the
outputs go different ways from there. That is the only legitimate cause of a difference; a
decoder bug would show up as a divergence at a token the target clearly did not prefer.

:func:`first_divergence` makes the check concrete: it finds the first differing position and
asks a float32 copy of the target (the referee) for its logits there, so a report can say
"differs at token 37, where the float32 logits of the two tokens are 0.03 apart" instead of
just "not identical". ``redraft-demo`` prints it for every differing prompt, and
``tests/infer/test_default_target.py`` asserts every bf16 divergence is such a near-tie.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1.0  # float32 logit gap below which a flipped argmax is rounding, not a bug


@dataclass
class Divergence:
    """The first position where two token sequences differ, judged by a float32 referee."""

    index: int  # position in the generated tokens
    got: int  # the speculative decoder's token there
    want: int  # plain greedy decoding's token there
    got_logit: float  # the referee's logits of both tokens after the shared prefix
    want_logit: float
    rank_got: int  # 1-based ranks of both tokens among the referee's logits
    rank_want: int

    @property
    def gap(self) -> float:
        return abs(self.got_logit - self.want_logit)

    @property
    def near_tie(self) -> bool:
        """Both tokens among the referee's top 3 and their logits within :data:`NEAR_TIE`."""
        return max(self.rank_got, self.rank_want) <= 3 and self.gap < NEAR_TIE

    def describe(self, tokenizer=None) -> str:
        def show(t: int) -> str:
            return repr(tokenizer.decode([t])) if tokenizer is not None else str(t)

        verdict = (
            "a near-tie that rounding flips"
            if self.near_tie
            else "NOT a near-tie: a decoder error; please report it with this prompt"
        )
        return (
            f"first differs at token {self.index}: {show(self.got)} vs plain {show(self.want)}; "
            f"float32 logits {self.got_logit:.3f} vs {self.want_logit:.3f} "
            f"(gap {self.gap:.3f}, ranks {self.rank_got} and {self.rank_want}): {verdict}"
        )


@torch.no_grad()
def first_divergence(
    referee, prompt_ids: list[int], got: list[int], want: list[int]
) -> Divergence | None:
    """``None`` if ``got`` and ``want`` agree on their common length, else the first position
    where they differ with ``referee``'s (a float32 ``Target``) logits of both tokens after
    ``prompt_ids + want[:index]``, the prefix both sequences share."""
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        return None
    ids = torch.tensor([list(prompt_ids) + list(want[:i])], device=referee.device)
    logits = referee.model(ids).logits[0, -1].float()
    a, b = int(got[i]), int(want[i])

    def rank(t: int) -> int:
        return int((logits > logits[t]).sum()) + 1

    return Divergence(i, a, b, float(logits[a]), float(logits[b]), rank(a), rank(b))
