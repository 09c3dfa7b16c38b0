"""TextStream: streamed text equals the whole decode, a character split over tokens is never sent
half, and a stop string is cut wherever the token boundaries fall."""

import random

import pytest
from checkpoint_helpers import text_model_folder

from fp8route.engine.detokenize import REPLACEMENT, TextStream
from fp8route.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(text_model_folder(tmp_path_factory.mktemp("text") / "tiny"))


def stream(tokenizer, ids, prompt=(), stop=(), per_push=1):
    text = TextStream(tokenizer, prompt, stop)
    pieces = [text.push(ids[i : i + per_push]) for i in range(0, len(ids), per_push)]
    pieces.append(text.push([], final=True))
    return pieces, text


def test_a_character_split_over_tokens_waits_until_it_is_whole(tokenizer):
    ids = tokenizer.encode("naïve café ☕ done", add_special_tokens=False).ids
    assert len(ids) > len("naïve café ☕ done")  # the tiny vocabulary splits each multi-byte character
    pieces, _ = stream(tokenizer, ids, prompt=tokenizer.encode("say:", add_special_tokens=False).ids)
    assert "".join(pieces) == "naïve café ☕ done"
    assert not any(REPLACEMENT in p for p in pieces)


@pytest.mark.parametrize("seed", range(5))
def test_random_tokens_stream_to_the_whole_decode(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(3, 262) for _ in range(60)]  # 3..261: no special tokens, any bytes
    prompt = tokenizer.encode("a prompt", add_special_tokens=False).ids
    for per_push in (1, 3):
        pieces, _ = stream(tokenizer, ids, prompt=prompt, per_push=per_push)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_prompt_ending_inside_a_character_leaves_it_to_the_output(tokenizer):
    ids = tokenizer.encode("é", add_special_tokens=False).ids
    assert len(ids) == 2
    pieces, _ = stream(tokenizer, [ids[1], *tokenizer.encode("x", add_special_tokens=False).ids], prompt=[ids[0]])
    assert "".join(pieces) == tokenizer.decode([ids[1]]) + "x"


def test_a_stop_string_across_tokens_is_cut_and_never_sent(tokenizer):
    ids = tokenizer.encode("one two END three", add_special_tokens=False).ids
    pieces, text = stream(tokenizer, ids, stop=["END", "never"])
    assert "".join(pieces) == "one two "
    assert text.stop_reason == "END"
    assert all("E" not in p for p in pieces)
    assert text.push(tokenizer.encode("more", add_special_tokens=False).ids) == ""


def test_text_that_only_looked_like_a_stop_string_is_released(tokenizer):
    ids = tokenizer.encode("an ENd EN", add_special_tokens=False).ids
    pieces, text = stream(tokenizer, ids, stop=["END"])
    assert pieces[3:6] == ["", "", "ENd"]  # "E" and "EN" waited until "d" showed them not to be "END"
    assert pieces[-3:] == ["", "", "EN"]  # and the end of the stream lets the last "EN" out
    assert "".join(pieces) == "an ENd EN" and text.stop_reason is None


def test_the_earliest_stop_string_wins(tokenizer):
    ids = tokenizer.encode("abc stop1 stop2", add_special_tokens=False).ids
    pieces, text = stream(tokenizer, ids, stop=["stop2", "c stop1"], per_push=100)
    assert "".join(pieces) == "ab" and text.stop_reason == "c stop1"
