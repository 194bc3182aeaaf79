"""Constants and helpers shared by the CUDA tests (imported as `cuda_helpers`, like tests/data's
data_helpers)."""

import json

import torch

from redraft.infer.spec.drafter import DecodeState, Draft, Drafter

DEVICE = "cuda"

# Chats for the tri-gram table and the trainer: sentences the tiny tokenizer was trained on, so
# the tables hold n-grams the prompts below continue.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and the target verifies them in one pass.",
    "Hello! How can I help you today? I am a helpful assistant.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
]
PROMPTS = [
    [{"role": "user", "content": "Hello there"}],
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    [{"role": "user", "content": "What is the capital of France?"}],
]


def write_chats(path, n: int = 240) -> str:
    """ShareGPT JSONL: each chat pairs two of SENTENCES (deterministic)."""
    with open(path, "w") as f:
        for i in range(n):
            a, b = SENTENCES[i % len(SENTENCES)], SENTENCES[(i * 7 + 3) % len(SENTENCES)]
            f.write(
                json.dumps(
                    {
                        "id": f"c{i}",
                        "conversations": [
                            {"from": "human", "value": a},
                            {"from": "gpt", "value": b},
                        ],
                    }
                )
                + "\n"
            )
    return str(path)


class OracleDrafter(Drafter):
    """Proposes the target's own greedy continuation (known in advance), cut to a length that
    varies by row and step so rows accept different numbers of tokens, plus a wrong sibling
    path: proof that multi-token acceptance really happens on the device."""

    name = "oracle"

    def __init__(self, futures, L=4):
        self.futures, self.L = futures, L  # request id -> full greedy token list

    def propose(self, state: DecodeState) -> Draft:
        B = state.batch_size
        out = torch.full((B, 2, self.L), -1, dtype=torch.long)
        for r in range(B):
            fut = self.futures[int(state.request_ids[r])]
            done = int(state.lengths[r] - state.prompt_lengths[r])  # tokens emitted so far
            good = fut[done : done + 1 + (int(state.step) + r) % self.L]
            out[r, 0, : len(good)] = torch.tensor(good, dtype=torch.long)
            out[r, 1, 0] = (fut[done] + 1) % 300 if done < len(fut) else 1
        return Draft(tokens=out)
