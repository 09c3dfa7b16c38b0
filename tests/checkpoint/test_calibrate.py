"""Calibration choices end to end on a tiny checkpoint with a tokenizer: --calib-text,
--input-scale, --keep-float, the record in config.json and in `inspect`, and bad input."""

import json

import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors, synthetic_gguf_metadata, write_checkpoint

from fp8route import Fp8InputError, load_checkpoint, quantize_checkpoint
from fp8route.checkpoint.calibration import read_text, text_token_ids
from fp8route.checkpoint.gguf_tokenizer import write_tokenizer
from fp8route.cli import main
from fp8route.engine import load_model
from fp8route.models.tokenizer import load_tokenizer

TEXT = (
    "Water boils at one hundred degrees at sea level.\nIt boils at a lower temperature in the mountains.\n\n"
    "The quarterly report shows revenue up 12% from last year, while costs rose 3%.\n\n"
    "def add(a, b):\n    return a + b\n"
)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    metadata = synthetic_gguf_metadata()
    config = dict(TINY, vocab_size=len(metadata["tokenizer.ggml.tokens"]))
    folder = write_checkpoint(tmp_path_factory.mktemp("src") / "bf16", llama_tensors(config), config)
    write_tokenizer(metadata, folder)
    return folder


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text(TEXT)
    return path


def test_text_is_packed_into_bounded_sequences(source, text_file):
    documents = read_text(text_file)
    assert len(documents) == 3 and documents[2].startswith("def add")
    tokenizer = load_tokenizer(source)
    every = [i for d in documents for i in tokenizer.encode(d).ids]
    sequences = text_token_ids(documents, tokenizer, seq_len=16, max_tokens=40)
    assert [len(s) for s in sequences] == [16, 16, 8]
    assert torch.cat(sequences).tolist() == every[:40]
    assert sum(len(s) for s in text_token_ids(documents, tokenizer, 16, 10**6)) == len(every)


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_cli_calib_text_keep_float_and_the_record(source, text_file, tmp_path, capsys, fmt):
    dst = tmp_path / "fp8"
    argv = ["quantize", str(source), str(dst), "--format", fmt, "--calib-text", str(text_file)]
    argv += ["--calib-seq-len", "16", "--calib-tokens", "40", "--input-scale", "percentile", "--percentile", "99.9"]
    assert main([*argv, "--keep-float", "2", "--device", "cpu", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "12 FP8 linears, 3 excluded" in out
    assert f"by percentile 99.9 on 40 tokens of text {text_file}" in out and "kept in float: 2 (" in out

    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    record = qc["fp8route"]
    assert record["calibration"] == {
        "estimator": "percentile",
        "percentile": 99.9,
        "tokens": 40,
        "sequences": 3,
        "source": f"text {text_file}",
        "clipped_linears": record["calibration"]["clipped_linears"],
    }
    kept = record["kept_float"]
    assert len(kept) == 2 and set(record["sensitivity"]["kept"]) == set(kept)
    # The kept linears are the two with the largest measured error, and in the standard exclusions.
    assert min(record["sensitivity"]["kept"].values()) >= record["sensitivity"]["largest_quantized"]
    assert sorted(qc["ignore"]) == sorted([*kept, "lm_head"])

    ckpt = load_checkpoint(dst, device="cpu", fuse=False)
    assert set(ckpt.excluded) == {*kept, "lm_head"} and len(ckpt.linears) == 12
    assert all(ckpt.tensors[f"{name}.weight"].dtype == torch.bfloat16 for name in kept)
    model = load_model(dst, device="cpu", dtype=torch.float32, max_num_seqs=1, max_model_len=32)
    assert model is not None

    assert main(["inspect", str(dst), "--device", "cpu"]) == 0
    shown = capsys.readouterr().out
    assert "calibration: input scales by percentile 99.9 on 40 tokens of text" in shown
    assert "kept in float: 2 (" in shown and kept[0] in shown


@pytest.mark.parametrize("estimator", ["max", "mse"])
def test_api_texts_and_estimators(source, tmp_path, estimator):
    report = quantize_checkpoint(
        source, tmp_path / estimator, calib=TEXT.split("\n\n"), device="cpu", input_scale=estimator, calib_seq_len=32
    )
    assert report.record["calibration"]["estimator"] == estimator and report.record["kept_float"] == []
    assert report.record["calibration"]["source"] == "text (3 str)"
    for name in report.quantized:
        choice = report.choices[name]
        assert 0 < choice.clip_fraction <= 1 and choice.scale * 448 <= choice.amax * (1 + 1e-6)
        if estimator == "max":
            assert choice.clip_fraction == 1.0
    ckpt = load_checkpoint(tmp_path / estimator, device="cpu", fuse=False)
    scales = {n: layer.input_scale.item() for n, layer in ckpt.linears.items()}
    assert scales == pytest.approx({n: report.choices[n].scale for n in report.quantized})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--input-scale", "percentile", "--percentile", "101"], "percentile must be in [90, 100]"),
        (["--keep-float", "99"], "keep_float=99 but only 14 linears would be quantized"),
        (["--calib-tokens", "0"], "calibration token budget must be a positive integer"),
    ],
)
def test_cli_bad_input_is_one_line(source, text_file, tmp_path, capsys, argv, message):
    rc = main(
        ["quantize", str(source), str(tmp_path / "x"), "--format", "modelopt", "--calib-text", str(text_file), *argv]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and err.startswith("fp8route quantize: ") and message in err
    assert not (tmp_path / "x").exists()


def test_text_needs_the_sources_tokenizer(tmp_path, text_file, capsys):
    src = write_checkpoint(tmp_path / "src", llama_tensors(), TINY)
    rc = main(["quantize", str(src), str(tmp_path / "x"), "--format", "modelopt", "--calib-text", str(text_file)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "calibrating on text needs the source's tokenizer" in err
    assert "no tokenizer.json" in err
    with pytest.raises(Fp8InputError, match="estimator must be one of max, percentile, mse, got 'minmax'"):
        quantize_checkpoint(src, tmp_path / "y", input_scale="minmax")
