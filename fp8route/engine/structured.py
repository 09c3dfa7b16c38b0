"""Structured output: a request's tokens held to a JSON schema, any JSON object, a regex or a fixed choice.

xgrammar compiles each spec against the tokenizer's vocabulary once (cached per spec); a request then holds a
Matcher that fills its row of a token bitmask before each step and accepts the token drawn. apply_bitmask turns
the bitmask into -inf logits with plain torch ops, so it runs on any device with no Triton and no host sync.

xgrammar is an optional extra: it is imported only inside the functions that need it.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fp8route.errors import Fp8InputError

if TYPE_CHECKING:
    import tokenizers

_CACHE_SIZE = 256  # compiled grammars kept; a server sees a few schemas many times, not thousands once
_ANY_OBJECT = '{"type": "object"}'
_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice"}
# xgrammar's C++ errors start with "[time] /path/file.cc:line: " and may say "Check failed: (cond) is false: ".
_LOG_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (?:Check failed: .*? is false: )?")


def _xgrammar() -> Any:
    """The xgrammar module, or the one-line error that says how to install it."""
    try:
        import xgrammar
    except ImportError:
        raise Fp8InputError(
            "structured output needs xgrammar, which the serve extra brings: pip install 'fp8route[serve]' "
            "(or 'fp8route[structured]' for xgrammar alone)"
        ) from None
    return xgrammar


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match (vLLM's StructuredOutputsParams): exactly one of these."""

    json: str | Mapping[str, Any] | None = None  # a JSON schema: JSON text (a dict given is dumped to text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # a list given becomes a tuple; each a non-empty string

    def __post_init__(self) -> None:
        given = [name for name in _WHAT if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise Fp8InputError("structured output: give exactly one of json, json_object, regex, choice")
        if not isinstance(self.json_object, bool):
            raise Fp8InputError(f"structured output: json_object must be True or False, got {_short(self.json_object)}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise Fp8InputError(f"structured output: regex must be a non-empty string, got {_short(self.regex)}")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))

    @property
    def kind(self) -> str:
        """Which one is set: "json", "json_object", "regex" or "choice"."""
        return next(name for name in _WHAT if getattr(self, name) not in (None, False))


def _schema_text(schema: object) -> str:
    """The schema as JSON text, checked to be a JSON object.

    A dict keeps its key order: xgrammar emits properties in the order the schema declares them, so sorting
    the keys would change the output, not just the cache key.
    """
    if isinstance(schema, dict):
        schema = json.dumps(schema)
    if not isinstance(schema, str):
        raise Fp8InputError(f"structured output: json must be a JSON schema (text or dict), got {_short(schema)}")
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as error:
        raise Fp8InputError(f"structured output: json is not valid JSON: {error}") from None
    if not isinstance(parsed, dict):
        raise Fp8InputError(f"structured output: json must be a JSON schema object, got {_short(parsed)}")
    return schema


def _choices(choice: object) -> tuple[str, ...]:
    """The choices as a tuple, each a non-empty string."""
    if isinstance(choice, (str, bytes)) or not isinstance(choice, (list, tuple)) or not choice:
        raise Fp8InputError(f"structured output: choice must be a non-empty list of strings, got {_short(choice)}")
    if not all(isinstance(item, str) and item for item in choice):
        raise Fp8InputError(f"structured output: each choice must be a non-empty string, got {_short(choice)}")
    return tuple(choice)


def _choice_ebnf(choice: tuple[str, ...]) -> str:
    # A JSON string literal is a valid EBNF string literal in xgrammar (same escapes), so quotes and
    # backslashes in a choice need nothing more.
    return "root ::= " + " | ".join(json.dumps(item, ensure_ascii=False) for item in choice)


def _reason(error: BaseException) -> str:
    """xgrammar's message on one line, without its source location."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return _LOG_PREFIX.sub("", lines[0]) if lines else type(error).__name__


@functools.cache
def _byte_level_alphabet() -> tuple[str, ...]:
    """GPT-2's bytes_to_unicode: the character that stands for each byte in a byte-level BPE vocabulary."""
    kept = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(256, 512))
    return tuple(chr(byte) if byte in kept else chr(next(shifted)) for byte in range(256))


def _decoders(decoder: object) -> list[dict[str, Any]]:
    """The decoder steps of a tokenizer.json, with Sequence decoders flattened."""
    if not isinstance(decoder, dict):
        return []
    if decoder.get("type") == "Sequence":
        return [step for inner in decoder.get("decoders", []) for step in _decoders(inner)]
    return [decoder]


def _vocab_type(xgr: Any, tokenizer: tokenizers.Tokenizer, vocab: dict[str, int]) -> Any:
    """How the vocabulary spells bytes, which xgrammar needs to decode every token to the bytes it emits.

    The vocabulary decides first: 256 "<0xNN>" pieces mean byte fallback whatever the decoder says (xgrammar's
    from_huggingface trusts the vocabulary the same way). Else the decoder: ByteLevel (GPT-2, Llama-3, SmolLM2)
    or a sentencepiece-style one (ByteFallback, Metaspace or a "▁" Replace), where "▁" stands for a space;
    xgrammar's own detection calls a bare Metaspace RAW and would leave "▁" in the text.
    """
    if sum(f"<0x{byte:02X}>" in vocab for byte in range(256)) >= 128:
        return xgr.VocabType.BYTE_FALLBACK
    steps = _decoders(json.loads(tokenizer.to_str()).get("decoder"))
    types = {step.get("type") for step in steps}
    if "ByteLevel" in types:
        return xgr.VocabType.BYTE_LEVEL
    spaces = any(step.get("type") == "Replace" and step.get("pattern", {}).get("String") == "▁" for step in steps)
    if spaces or types & {"ByteFallback", "Metaspace"}:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def _adds_prefix_space(xgr: Any, tokenizer: tokenizers.Tokenizer, vocab_type: Any) -> bool:
    """Whether encoding prepends a space (xgrammar keeps it as metadata), seen from how "a" encodes."""
    if vocab_type == xgr.VocabType.RAW:
        return False
    tokens = tokenizer.encode("a", add_special_tokens=False).tokens
    return bool(tokens) and tokens[0].startswith("▁" if vocab_type == xgr.VocabType.BYTE_FALLBACK else "Ġ")


def _encoded_vocab(
    tokenizer: tokenizers.Tokenizer, vocab: dict[str, int], vocab_size: int, byte_level: bool
) -> list[str]:
    """Each id's token as xgrammar reads it; "" marks an id no grammar may produce.

    Special added tokens become "": their text ("<|im_start|>") would otherwise be allowed inside a JSON
    string, and the detokenizer drops it. Stop tokens are allowed by id, not by text, so EOS still ends the
    output. Ids past the tokenizer's (a padded lm_head) stay "" too. A non-special added token is stored as
    plain text, so in a byte-level vocabulary it is spelled in the byte alphabet first.
    """
    encoded = [""] * vocab_size
    for token, index in vocab.items():
        if index < vocab_size:
            encoded[index] = token
    alphabet = _byte_level_alphabet()
    for index, added in tokenizer.get_added_tokens_decoder().items():
        if index >= vocab_size:
            continue
        if added.special:
            encoded[index] = ""
        elif byte_level:
            encoded[index] = "".join(alphabet[byte] for byte in added.content.encode())
    return encoded


def _tokenizer_info(xgr: Any, tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """xgrammar's TokenizerInfo for a `tokenizers.Tokenizer` (from_huggingface wants a transformers one)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    vocab_type = _vocab_type(xgr, tokenizer, vocab)
    return xgr.TokenizerInfo(
        _encoded_vocab(tokenizer, vocab, vocab_size, byte_level=vocab_type == xgr.VocabType.BYTE_LEVEL),
        vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=eos_token_ids,
        add_prefix_space=_adds_prefix_space(xgr, tokenizer, vocab_type),
    )


class Matcher:
    """One request's place in its grammar: fill its bitmask row before a step, accept the token drawn."""

    def __init__(self, matcher: Any, stop_token_ids: tuple[int, ...]) -> None:
        self._matcher = matcher
        self._stop_token_ids = stop_token_ids

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Row `index` of the CPU int32 bitmask := the tokens allowed next.

        After the grammar ended (a stop token accepted) only stop tokens are allowed, so a request that
        ignores EOS keeps producing nothing but EOS instead of text outside the grammar.
        """
        if not self.terminated:
            self._matcher.fill_next_token_bitmask(bitmask, index)
            return
        bitmask[index] = 0
        for token in self._stop_token_ids:
            bitmask[index, token // 32] |= _bit(token % 32)

    def accept(self, token: int) -> None:
        """Advance past `token`. A token the grammar refuses means the sampler ignored the mask: an engine bug."""
        if self.terminated and token in self._stop_token_ids:
            return
        if not self._matcher.accept_token(int(token)):
            raise RuntimeError(f"structured output: the grammar refused token {token} (was the bitmask applied?)")

    @property
    def terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""
        return bool(self._matcher.is_terminated())


def _bit(position: int) -> int:
    """The int32 value with only bit `position` set (bit 31 is the sign bit)."""
    return -(1 << 31) if position == 31 else 1 << position


class Grammars:
    """The structured-output grammars of one model: its tokenizer's vocabulary, compiled specs, matchers.

    One per engine. compile() may be called from several threads: the cache is locked, compiling is not.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        xgr = _xgrammar()
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise Fp8InputError(f"structured output: vocab_size must be an integer >= 1, got {_short(vocab_size)}")
        eos = tuple(eos_token_ids)
        if not eos or not all(isinstance(i, int) and 0 <= i < vocab_size for i in eos):
            raise Fp8InputError(
                f"structured output: eos_token_ids must be one or more ids in [0, {vocab_size}), got {_short(eos)}"
            )
        self.vocab_size = vocab_size
        self.eos_token_ids = eos
        self.tokenizer_info = _tokenizer_info(xgr, tokenizer, vocab_size, list(eos))
        # xgrammar's own cache has no bound by default; ours below has one.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        self._matcher_class = xgr.GrammarMatcher
        # Fills a step's rows on xgrammar's own threads (half the cores): one 128k-token row takes ~0.1 ms.
        self._batch = xgr.BatchGrammarMatcher()
        self._cache: OrderedDict[StructuredOutputs, Any] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def words(self) -> int:
        """int32 words in a bitmask row: ceil(vocab_size / 32)."""
        return -(-self.vocab_size // 32)

    def compile(self, spec: StructuredOutputs) -> object:
        """The compiled grammar of `spec`, from the cache when it was compiled before."""
        if not isinstance(spec, StructuredOutputs):
            raise Fp8InputError(f"structured output: expected StructuredOutputs, got {type(spec).__name__}")
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        # Compiled outside the lock so that one large schema does not hold up every other request.
        compiled = self._compile(spec)
        with self._lock:
            compiled = self._cache.setdefault(spec, compiled)  # a racing thread's result wins: one object per spec
            self._cache.move_to_end(spec)
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs) -> object:
        # any_whitespace=False: one line with json.dumps' ", " and ": ", so that a small model cannot loop
        # in whitespace. A JSON object goes through the schema compiler too: xgrammar's builtin JSON grammar
        # allows any whitespace and top-level arrays.
        try:
            if spec.json is not None:
                return self._compiler.compile_json_schema(spec.json, any_whitespace=False)
            if spec.json_object:
                return self._compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False)
            if spec.regex is not None:
                return self._compiler.compile_regex(spec.regex)
            assert spec.choice is not None
            return self._compiler.compile_grammar(_choice_ebnf(spec.choice))
        except (RuntimeError, ValueError) as error:
            raise Fp8InputError(f"structured output: cannot compile the {_WHAT[spec.kind]}: {_reason(error)}") from None

    def matcher(self, spec: StructuredOutputs) -> Matcher:
        """A new Matcher for one request, at the start of `spec`'s grammar."""
        return Matcher(self._matcher_class(self.compile(spec)), self.eos_token_ids)

    def fill(self, bitmask: torch.Tensor, matchers: Sequence[Matcher | None]) -> None:
        """Row j of the CPU int32 bitmask := what matchers[j] allows next (None: the row is left as it is),
        the rows of running grammars filled in parallel."""
        running: list[tuple[int, Matcher]] = []
        for j, m in enumerate(matchers):
            if m is not None and m.terminated:
                m.fill(bitmask, j)  # its stop tokens only
            elif m is not None:
                running.append((j, m))
        if running:
            rows, handles = zip(*((j, m._matcher) for j, m in running), strict=True)
            self._batch.batch_fill_next_token_bitmask(list(handles), bitmask, list(rows))

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """An int32 [rows, words] CPU bitmask with every token allowed (the row of a request without a grammar)."""
        return torch.full((rows, self.words), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [R, V] with -inf where `bitmask` (int32 [R, ceil(V / 32)], same device) has a 0 bit.

    Bit i of word w is token 32 w + i. Unpacked through a uint8 view (bit i of a word is bit i % 8 of its byte
    i // 8 on a little-endian host, where xgrammar filled it), so the temporary is R x V bytes, not 4x that.
    Plain torch ops: any device, no Triton, nothing waits on the host. Returns a new tensor.
    """
    rows, vocab = logits.shape
    words = -(-vocab // 32)
    if bitmask.dtype != torch.int32 or tuple(bitmask.shape) != (rows, words):
        raise Fp8InputError(
            f"apply_bitmask: bitmask must be int32 [{rows}, {words}] for logits [{rows}, {vocab}], "
            f"got {bitmask.dtype} {list(bitmask.shape)}"
        )
    as_bytes = bitmask.contiguous().view(torch.uint8)
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    bits = ((as_bytes[:, :, None] >> shifts) & 1).view(rows, words * 32)[:, :vocab]
    return logits.masked_fill(bits == 0, float("-inf"))
