"""The embedded tokenizer and task corpus."""

import random

import pytest

from titan_mok.data import UNKNOWN, VOCAB_SIZE, CharTokenizer, TaskDataset, make_line


def test_tokenizer_round_trip_and_vocab():
    tok = CharTokenizer()
    text = "sort 3 1 2 = 1 2 3\nrev paw = wap"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids) < VOCAB_SIZE
    assert tok.decode(ids) == text


def test_ids_without_a_character_stay_visible():
    tok = CharTokenizer()
    one, two = tok.encode("12")
    assert tok.decode([tok.bos_id, one, 120, two, tok.eos_id, tok.pad_id]) == "1" + UNKNOWN + "2"


def test_tokenizer_rejects_unknown_characters():
    with pytest.raises(ValueError, match="'é' is not printable ASCII"):
        CharTokenizer().encode("café")


def test_task_answers_are_correct():
    for i in range(200):
        line = make_line(random.Random(i))
        task, question, answer = line.split(" ", 1)[0], line.split(" = ")[0].split(" ", 1)[1], line.split(" = ")[1]
        if task == "sort":
            assert answer.split() == sorted(question.split(), key=int)
        elif task == "add":
            a, b = question.split(" + ")
            assert int(answer) == int(a) + int(b)
        else:
            assert answer == question[::-1]


def _take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


def test_windows_are_contiguous_and_shifted():
    (x0, y0), (x1, _) = _take(TaskDataset(CharTokenizer(), 32, dp_rank=0), 2)
    assert x0["input"][1:].tolist() == y0[:-1].tolist()
    assert x1["input"][0] == y0[-1]


def test_stream_is_reproducible_and_rank_dependent():
    a = _take(TaskDataset(CharTokenizer(), 32, dp_rank=0, seed=3), 3)
    b = _take(TaskDataset(CharTokenizer(), 32, dp_rank=0, seed=3), 3)
    c = _take(TaskDataset(CharTokenizer(), 32, dp_rank=1, seed=3), 3)
    assert all(x["input"].equal(y["input"]) for (x, _), (y, _) in zip(a, b))
    assert not a[0][0]["input"].equal(c[0][0]["input"])


def test_resume_from_state_dict():
    ds = TaskDataset(CharTokenizer(), 32, dp_rank=0)
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = ds.state_dict()
    expected = [next(it) for _ in range(3)]
    resumed = TaskDataset(CharTokenizer(), 32, dp_rank=0)
    resumed.load_state_dict(state)
    got = _take(resumed, 3)
    assert all(x["input"].equal(y["input"]) for (x, _), (y, _) in zip(expected, got))
