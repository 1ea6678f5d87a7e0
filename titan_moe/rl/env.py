"""The environment protocol: an episode is a prompt, then turns of (model action, tool result).

    episode = env.reset(rng)                      # episode.prompt: text for the first turn
    result = env.step(episode, action_text)       # one model turn, decoded to text
    result.done  -> result.reward, result.success (the trajectory is over)
    else         -> result.observation            (tool output, fed to the model; next turn)

A turn of the model ends at eos or at TOOL_CALL_END (both stop decoding). An environment must
never take the run down: a tool that hangs or crashes ends its own trajectory with reward 0
(the sandbox enforces time and memory limits; rollouts also catch exceptions from `step`).
"""

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

TOOL_CALL_END = "<|reserved_0|>"


class Tokenizer(Protocol):
    bos_id: int
    eos_id: int

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...


@dataclass
class Episode:
    prompt: str
    task: Any = None
    turns: int = 0
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    done: bool
    reward: float = 0.0
    success: bool = False
    observation: str = ""
    info: str = ""


class Environment(Protocol):
    max_turns: int

    def reset(self, rng: random.Random) -> Episode: ...

    def step(self, episode: Episode, action: str) -> StepResult: ...
