"""A toy environment a tiny random model learns in tens of updates, and its character tokenizer.

TargetCharEnv: the prompt is two random letters; each of `max_turns` turns the model writes up to
the turn budget of characters, the environment answers the first turns with "=" (a stand-in tool
result) and the reward is the fraction of all action characters equal to `target`.
"""

import random

from titan_moe.rl.env import TOOL_CALL_END, Episode, StepResult

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", TOOL_CALL_END]


class CharTokenizer:
    """One token per character of `alphabet`, after the special tokens."""

    def __init__(self, alphabet: str = "abcdefgh=") -> None:
        self.vocab = SPECIALS + list(alphabet)
        self.ids = {t: i for i, t in enumerate(self.vocab)}
        self.bos_id, self.eos_id = self.ids["<|bos|>"], self.ids["<|eos|>"]

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        return [self.bos_id] * add_bos + [self.ids[c] for c in text] + [self.eos_id] * add_eos

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        skip = len(SPECIALS) if skip_special_tokens else 0
        return "".join(self.vocab[i] for i in ids if skip <= i < len(self.vocab))

    def token_to_id(self, token: str) -> int | None:
        return self.ids.get(token)

    def get_vocab_size(self) -> int:
        return len(self.vocab)


class TargetCharEnv:
    def __init__(self, target: str = "a", max_turns: int = 2, letters: str = "abcdefgh") -> None:
        self.target = target
        self.max_turns = max_turns
        self.letters = letters

    def reset(self, rng: random.Random) -> Episode:
        return Episode("".join(rng.choice(self.letters) for _ in range(2)), notes={"chars": ""})

    def step(self, episode: Episode, action: str) -> StepResult:
        episode.turns += 1
        episode.notes["chars"] += action
        if episode.turns < self.max_turns:
            return StepResult(done=False, observation="=")
        chars = episode.notes["chars"]
        reward = chars.count(self.target) / len(chars) if chars else 0.0
        return StepResult(done=True, reward=reward, success=reward == 1.0)
