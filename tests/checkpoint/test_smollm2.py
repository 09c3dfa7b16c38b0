"""fp8route.checkpoint.smollm2: which folder each scheme and name asks for, and the mistakes refused
before anything is converted or quantized."""

import pytest

from fp8route.checkpoint import smollm2
from fp8route.errors import Fp8InputError


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"scheme": "int8"}, "unknown FP8 scheme 'int8'; known: tensor, channel, block"),
        (
            {"fp8": False, "scheme": "block"},
            "scheme='block' names an FP8 folder; the bf16 one (fp8=False) has no scheme",
        ),
    ],
)
def test_a_scheme_that_names_no_folder_is_one_line(monkeypatch, kwargs, message):
    monkeypatch.setattr(smollm2, "packaged_gguf", lambda: pytest.fail("read the GGUF before checking the scheme"))
    with pytest.raises(Fp8InputError) as e:
        smollm2.smollm2_folder(**kwargs)
    assert str(e.value) == message


class _Ids:
    """A tokenizer whose every text is three ids."""

    def encode(self, text):
        return type("Encoding", (), {"ids": [1, 2, 3]})()


def test_every_scheme_has_its_own_cached_folder(tmp_path, monkeypatch):
    """Each scheme quantized once from the one bf16 folder, into a folder of its own, and found there after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    monkeypatch.setattr(smollm2, "packaged_gguf", lambda: gguf)
    models = tmp_path / "fp8route" / "models"
    (models / f"{smollm2.NAME}-bf16").mkdir(parents=True)
    (models / f"{smollm2.NAME}-bf16" / "config.json").write_text("{}")
    made: list[tuple[str, str, str | None]] = []

    def quantize(src, dst, format=None, calib=None, device=None, progress=None, scheme="tensor"):
        made.append((dst.name, scheme, format))
        dst.mkdir()
        (dst / "config.json").write_text("{}")

    monkeypatch.setattr(smollm2, "quantize_checkpoint", quantize)
    monkeypatch.setattr("fp8route.models.tokenizer.load_tokenizer", lambda folder: _Ids())
    for _ in range(2):
        folders = {name: smollm2.named_folder(name) for name in smollm2.NAMES}
    assert {name: f.name for name, f in folders.items()} == {
        "smollm2": f"{smollm2.NAME}-fp8",
        "smollm2-channel": f"{smollm2.NAME}-fp8-channel",
        "smollm2-block": f"{smollm2.NAME}-fp8-block",
        "smollm2-bf16": f"{smollm2.NAME}-bf16",
    }
    assert made == [
        (f"{smollm2.NAME}-fp8", "tensor", "modelopt"),
        (f"{smollm2.NAME}-fp8-channel", "channel", None),
        (f"{smollm2.NAME}-fp8-block", "block", None),
    ]


def test_an_unknown_name_is_refused():
    with pytest.raises(Fp8InputError, match="unknown SmolLM2 name 'smollm2-int8'; known: smollm2, smollm2-channel"):
        smollm2.named_folder("smollm2-int8")
