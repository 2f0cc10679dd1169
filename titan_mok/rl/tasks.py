"""Verifiable prompts for RL: the embedded task lines (``titan_mok.data``) cut at
" = ", with an exact reward.

``sort 8 3 5 1 = `` → the policy must write ``1 3 5 8`` and a newline. Prompt
``g`` of a run is a pure function of (seed, g), so the data position of a run
is one integer (saved in RL checkpoints).

Reward in [0, 1], per answer position: 1 for the answer's character, 1/2 for
another character of the same class (digit, letter, space, other), 0 otherwise;
summed and divided by the longer of answer and completion (so 1 exactly for the
exact answer; extra or missing characters lower it). The half credit is a format
reward: it gives a randomly initialised debug model a gradient within a few
steps. Exact and cheap: no model judges it.
"""

from dataclasses import dataclass

from titan_mok.data import line_rng, make_line


@dataclass(frozen=True)
class Prompt:
    index: int
    """Global prompt index in the run (seeds the line and the sampling streams)."""
    text: str
    """The question including " = ", e.g. ``"add 4 + 38 = "``."""
    answer: str
    """The exact answer, without the newline that ends it."""


def make_prompt(seed: int, index: int) -> Prompt:
    question, answer = make_line(line_rng(seed, 0, index)).split(" = ")
    return Prompt(index=index, text=question + " = ", answer=answer)


def completion_text(completion: str) -> str:
    """The answer part of a decoded completion: up to its first newline."""
    return completion.split("\n", 1)[0]


def _char_class(ch: str) -> str:
    return "digit" if ch.isdigit() else "letter" if ch.isalpha() else "space" if ch == " " else "other"


def reward(completion: str, answer: str) -> float:
    written = completion_text(completion)
    credit = sum(1.0 if w == a else 0.5 if _char_class(w) == _char_class(a) else 0.0 for w, a in zip(written, answer))
    return credit / max(len(written), len(answer))
