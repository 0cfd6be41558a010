"""Benchmark workloads of the project's design notes, as lists of token-id prompts (deterministic per seed)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    group: int  # prefix group (-1: none)


def gsp(num_groups: int = 8, prompts_per_group: int = 8, system_len: int = 1024, question_len: int = 64,
        output_len: int = 32, vocab: int = 32000, seed: int = 0, zipf_alpha: float | None = None,
        num_requests: int | None = None) -> list[Request]:
    """Generated shared prefix (SGLang's GSP): groups of prompts sharing a random system prompt.

    Uniform: every group gets ``prompts_per_group`` requests, shuffled. Zipf: ``num_requests`` requests
    whose group is drawn with probability ~ 1/rank**alpha (hot prefixes)."""
    rng = random.Random(seed)
    lo = 3  # keep clear of the byte tokenizer's lowest ids (not required, just tidy)
    systems = [[rng.randrange(lo, vocab) for _ in range(system_len)] for _ in range(num_groups)]
    if zipf_alpha is None:
        groups = [g for g in range(num_groups) for _ in range(prompts_per_group)]
        rng.shuffle(groups)
    else:
        weights = [1.0 / (r + 1) ** zipf_alpha for r in range(num_groups)]
        n = num_requests or num_groups * prompts_per_group
        groups = rng.choices(range(num_groups), weights=weights, k=n)
    return [Request(systems[g] + [rng.randrange(lo, vocab) for _ in range(question_len)], output_len, g)
            for g in groups]


def no_share(num_requests: int = 64, prompt_len: int = 1024 + 64, output_len: int = 32, vocab: int = 32000,
             seed: int = 1) -> list[Request]:
    """Same lengths as gsp-small, no shared prefix: caching must cost about nothing here."""
    rng = random.Random(seed)
    return [Request([rng.randrange(3, vocab) for _ in range(prompt_len)], output_len, -1)
            for _ in range(num_requests)]


def multiturn(num_users: int = 8, num_rounds: int = 4, system_len: int = 256, turn_len: int = 64,
              answer_len: int = 32, vocab: int = 32000, seed: int = 2) -> list[list[Request]]:
    """Chats whose history grows each round; round r of a user extends round r-1's prompt (answers are
    stand-ins drawn at random, as a client replaying a fixed conversation would send)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(system_len)]
    rounds: list[list[Request]] = []
    histories = [list(system) for _ in range(num_users)]
    for _ in range(num_rounds):
        batch = []
        for u in range(num_users):
            histories[u] = histories[u] + [rng.randrange(3, vocab) for _ in range(turn_len)]
            batch.append(Request(list(histories[u]), answer_len, u))
            histories[u] = histories[u] + [rng.randrange(3, vocab) for _ in range(answer_len)]
        rounds.append(batch)
    return rounds


WORKLOADS = {
    "gsp-small": lambda: gsp(),
    "gsp-zipf": lambda: gsp(num_groups=64, zipf_alpha=1.0, num_requests=4096),
    "no-share": lambda: no_share(),
}
