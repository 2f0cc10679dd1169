"""The embedded default data: a character tokenizer and a generated text task.

Nothing is downloaded. The corpus is an endless stream of small, exactly
checkable lines, e.g.::

    sort 8 3 5 1 = 1 3 5 8
    add 47 + 385 = 432
    rev kitten = nettik

The left-hand side is random (its loss floor is its entropy); the right-hand
side is a function of it, so a model that learns the tasks drives that part of
the loss towards zero: the falling loss is visible within a few dozen steps.
Each (data-parallel rank, line index) pair has its own seeded generator, so the
stream is reproducible, independent of the number of workers, and resumable
from the line index alone (the dataset is Stateful for TorchTitan's DCP
checkpoints).
"""

import random
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer

# Printable ASCII plus newline, after three special tokens.
_SPECIALS = ("<pad>", "<bos>", "<eos>")
_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = 128
"""Tokenizer vocabulary, rounded up to a multiple of 64 (debug flavors use it)."""
assert len(_SPECIALS) + len(_CHARS) <= VOCAB_SIZE

UNKNOWN = "\ufffd"
"""What an id without a character decodes to."""

_WORDS = ("kitten", "tabby", "whisker", "paw", "purr", "mouse", "yarn", "meow", "claw", "nap")


class CharTokenizer(BaseTokenizer):
    """One token per character of printable ASCII; BOS/EOS/PAD as specials."""

    def __init__(self):
        super().__init__()
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._id_of = {ch: i + len(_SPECIALS) for i, ch in enumerate(_CHARS)}
        self._char_of = {i: ch for ch, i in self._id_of.items()}

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        try:
            ids = [self._id_of[ch] for ch in text]
        except KeyError as e:
            raise ValueError(f"CharTokenizer: character {e.args[0]!r} is not printable ASCII or newline") from None
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: list[int]) -> str:
        """Special tokens decode to nothing; an id with no character (99..127, which a
        sampler can still pick) to U+FFFD, so it is visible in the text, never dropped."""
        return "".join(self._char_of.get(int(i), "" if int(i) < len(_SPECIALS) else UNKNOWN) for i in ids)

    def get_vocab_size(self) -> int:
        return VOCAB_SIZE


def make_line(rng: random.Random) -> str:
    """One task line: its answer is a deterministic function of its question."""
    task = rng.randrange(3)
    if task == 0:
        xs = [rng.randrange(10) for _ in range(rng.randint(3, 8))]
        return f"sort {' '.join(map(str, xs))} = {' '.join(map(str, sorted(xs)))}"
    if task == 1:
        a, b = rng.randrange(1000), rng.randrange(1000)
        return f"add {a} + {b} = {a + b}"
    word = "".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 2)))
    return f"rev {word} = {word[::-1]}"


def line_rng(seed: int, dp_rank: int, index: int) -> random.Random:
    # A string seed is hashed with SHA-512 by `random`: stable across processes.
    return random.Random(f"{seed}/{dp_rank}/{index}")


class TaskDataset(IterableDataset, Stateful):
    """Endless token stream of task lines, cut into (input, label) windows."""

    def __init__(self, tokenizer: BaseTokenizer, seq_len: int, dp_rank: int, seed: int = 0):
        if seq_len < 16:
            raise ValueError(f"training.seq_len = {seq_len}: the task dataset needs at least 16")
        self.tokenizer, self.seq_len, self.dp_rank, self.seed = tokenizer, seq_len, dp_rank, seed
        self._line_index = 0  # next line to generate
        self._buffer: list[int] = []  # tokens generated but not yet emitted

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        window = self.seq_len + 1
        while True:
            while len(self._buffer) < window:
                rng = line_rng(self.seed, self.dp_rank, self._line_index)
                self._buffer += self.tokenizer.encode(make_line(rng) + "\n", add_bos=True)
                self._line_index += 1
            tokens = torch.tensor(self._buffer[:window], dtype=torch.long)
            self._buffer = self._buffer[self.seq_len :]  # keep the last token as the next input
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"line_index": self._line_index, "buffer": list(self._buffer)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._line_index = state_dict["line_index"]
        self._buffer = list(state_dict["buffer"])


def build_char_tokenizer(job_config=None) -> CharTokenizer:
    return CharTokenizer()


def build_task_dataloader(dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer, job_config, infinite: bool = True):
    if not infinite:
        raise ValueError("the task corpus is an endless stream: build_task_dataloader needs infinite=True")
    if job_config.training.dataset != "tasks":
        raise ValueError(f"[training] dataset = {job_config.training.dataset!r}: titan-mok's models train on the embedded dataset \"tasks\"")
    dataset = TaskDataset(tokenizer, job_config.training.seq_len, dp_rank, seed=job_config.debug.seed or 0)
    return ParallelAwareDataloader(
        dataset,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        batch_size=job_config.training.local_batch_size,
    )
