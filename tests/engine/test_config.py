"""EngineConfig: every bad value refused at construction in one line naming the setting (on a command
line, naming the flag); the flags, their defaults and help made from the fields; the same seed gives
the same text through LLM.generate and the model's static generate."""

import argparse
import os

import pytest
import torch
from checkpoint_helpers import text_model_folder

import fp8route
from fp8route import LLM, Fp8InputError, SamplingParams
from fp8route.engine import EngineConfig
from fp8route.engine.config import Flag, add_engine_args, check_setting, sweep_values
from fp8route.engine.generate import generate


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"cpu_threads": 0}, "cpu_threads must be an integer >= 1, got 0"),
        ({"dtype": "float64"}, "dtype must be one of bfloat16, float16, float32, got 'float64'"),
        ({"dtype": torch.int8}, "dtype must be one of bfloat16, float16, float32, got 'torch.int8'"),
        ({"device": "gpu7"}, "device must be cuda, cuda:N or cpu, got 'gpu7'"),
        ({"max_model_len": 0}, "max_model_len must be an integer >= 1, got 0"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1, got 0"),
        ({"max_num_seqs": 2.5}, "max_num_seqs must be an integer >= 1, got 2.5"),
        ({"max_num_batched_tokens": -3}, "max_num_batched_tokens must be an integer >= 1, got -3"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "max_num_batched_tokens (32) must be at least"),
        ({"admission": "fcfs"}, "admission must be one of on_demand, reserve, got 'fcfs'"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be in (0, 1], got 0"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1], got 1.5"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization must be in (0, 1], got nan"),
        ({"num_kv_blocks": 1}, "num_kv_blocks must be at least 2 (one is scratch), got 1"),
        ({"block_size": 12}, "block_size must be a power of two, got 12"),
        ({"block_size": True}, "block_size must be an integer >= 1, got True"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype must be one of auto, fp8, got 'int8'"),
        ({"attention": "flash"}, "attention must be one of builtin, flashinfer, got 'flash'"),
        ({"tp": 0}, "tp must be an integer >= 1, got 0"),
        ({"all_reduce": "mpi"}, "all_reduce must be one of nccl, symm_mem, fused, got 'mpi'"),
        ({"tp_lm_head": "rows"}, "tp_lm_head must be one of vocab, replicated, got 'rows'"),
        ({"attention": "flashinfer", "async_scheduling": True}, "async_scheduling does not run with attention="),
    ],
)
def test_each_bad_setting_is_one_line_naming_it(settings, message):
    with pytest.raises(Fp8InputError) as caught:
        EngineConfig(**settings)
    text = str(caught.value)
    assert message in text and "\n" not in text


def parser(*names: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="x")
    add_engine_args(p, names)
    return p


def test_flags_come_from_the_fields_with_their_defaults_and_help():
    p = parser("max_num_seqs", "enable_prefix_caching", "kv_cache_dtype", "async_scheduling")
    text = p.format_help()
    assert "--max-num-seqs MAX_NUM_SEQS" in text and "(default: 256)" in text
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in text and "{auto,fp8}" in text
    args = p.parse_args(["--max-num-seqs", "8", "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8"])
    config = EngineConfig.from_args(args)
    assert (config.max_num_seqs, config.enable_prefix_caching, config.kv_cache_dtype) == (8, False, "fp8")
    assert config.async_scheduling is None  # default: decided by the device


def test_a_bad_flag_names_the_flag():
    with pytest.raises(Fp8InputError, match=r"^--kv-cache-dtype must be one of auto, fp8, got 'fp4'$"):
        EngineConfig.from_args(parser("kv_cache_dtype").parse_args(["--kv-cache-dtype", "fp4"]))
    with pytest.raises(Fp8InputError, match=r"^--max-num-seqs must be an integer >= 1, got 0$"):
        EngineConfig.from_args(parser("max_num_seqs").parse_args(["--max-num-seqs", "0"]))


def test_the_token_budget_defaults_by_device():
    assert EngineConfig().batched_tokens(torch.device("cuda")) == 8192
    # A step of 512 tokens is about a second of a 2-core CPU: a long prompt cannot stall the others longer.
    assert EngineConfig(max_num_seqs=4).batched_tokens(torch.device("cpu")) == 512
    assert EngineConfig(max_num_batched_tokens=100, max_num_seqs=4).batched_tokens(torch.device("cpu")) == 100


def test_a_long_prompt_on_a_cpu_is_chunked_while_a_running_stream_moves_every_step(tmp_path):
    folder = text_model_folder(tmp_path / "m", max_positions=2048)
    llm = LLM(folder, device="cpu", dtype="float32", max_num_seqs=4, max_model_len=2048)
    engine = llm.engine
    running = engine.add_request([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    long = engine.add_request([3 + i % 250 for i in range(1500)], SamplingParams(max_tokens=1, ignore_eos=True))
    steps = 0
    while not long.finished:
        before = running.num_output_tokens
        engine.step()
        steps += 1
        assert running.num_output_tokens == before + 1  # the stream gets its token every step
    assert steps == 3  # 1500 prompt tokens in chunks of the 512-token budget (less the stream's one)


def test_cpu_threads_come_from_the_cores_this_process_may_use(monkeypatch):
    for name in ("OMP_NUM_THREADS", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert EngineConfig().threads() == 7  # one core left to the host thread
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert EngineConfig().threads() == 3  # shared among the ranks
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert EngineConfig().threads() == 1
    assert EngineConfig(cpu_threads=5).threads() == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert EngineConfig().threads() is None  # the user's own setting stands


def test_a_cpu_engine_computes_with_those_threads_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    asked: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    LLM(text_model_folder(tmp_path / "m"), device="cpu", max_num_seqs=2)
    assert asked == [2]
    assert "CPU threads" in capsys.readouterr().err


def test_the_same_seed_gives_the_same_text_through_llm_generate_and_the_models_generate(tmp_path):
    llm = LLM(text_model_folder(tmp_path / "m"), device="cpu", dtype="float32", max_num_seqs=4)
    ids = torch.randint(3, 200, (3, 7), generator=torch.Generator().manual_seed(4))
    params = SamplingParams(max_tokens=8, temperature=1.2, top_p=0.9, seed=11, ignore_eos=True)
    offline = llm.generate([row.tolist() for row in ids], params, use_tqdm=False)
    static = generate(llm.engine, ids, 8, temperature=1.2, top_p=0.9, seed=11)
    assert [o.token_ids for o in offline] == static[:, 7:].tolist()
    assert [o.text for o in offline] == [
        llm.tokenizer.decode(row, skip_special_tokens=True) for row in static[:, 7:].tolist()
    ]


def test_a_pool_too_small_on_a_cpu_names_the_cpu_setting(tmp_path):
    llm = LLM(text_model_folder(tmp_path / "m"), device="cpu", max_num_seqs=2, num_kv_blocks=3)
    with pytest.raises(Fp8InputError, match=r"larger KV cache \(num_kv_blocks, or gpu_memory_utilization on a GPU\)"):
        llm.generate([list(range(3, 40))], SamplingParams(max_tokens=8), use_tqdm=False)


def sweep(**flags: str):
    """The values sweep_values reads from these flags' text."""
    args = argparse.Namespace(**flags)
    return {name: sweep_values(args, name) for name in flags}


def test_a_sweep_flag_is_the_fields_values_comma_separated_each_checked_once():
    assert sweep(tp="1, 2,1", attention="builtin", prefill_graphs="off,on,off", kv_cache_dtype="fp8 auto") == {
        "tp": [1, 2], "attention": ["builtin"], "prefill_graphs": [False, True], "kv_cache_dtype": ["fp8", "auto"],
    }  # fmt: skip
    for flags, message in [
        ({"tp": "1,0"}, r"^--tp must be an integer >= 1, got 0$"),
        ({"tp": "1,x"}, r"^--tp: expected integers separated by commas, got '1,x'$"),
        ({"all_reduce": "nccl,mpi"}, r"^--all-reduce must be one of nccl, symm_mem, fused, got 'mpi'$"),
        ({"prefill_graphs": "yes"}, r"^--prefill-graphs: on, off or on,off, got 'yes'$"),
        ({"use_cuda_graphs": ""}, r"^--use-cuda-graphs: on, off or on,off, got ''$"),
        ({"attention": " , "}, r"^--attention ' , ': one or more of builtin, flashinfer, comma-separated$"),
    ]:
        with pytest.raises(Fp8InputError, match=message):
            sweep(**flags)
    with pytest.raises(Fp8InputError, match=r"^--prefix-caching: on, off or on,off"):
        sweep_values(argparse.Namespace(enable_prefix_caching="1"), "enable_prefix_caching", "--prefix-caching")


def test_a_command_may_spell_a_flag_its_own_way_and_give_its_own_default():
    p = argparse.ArgumentParser(prog="x")
    prefix, graphs = Flag(spelling="--prefix-caching"), Flag(default=False)
    add_engine_args(p, ["enable_prefix_caching", "prefill_graphs"], sweep=True, enable_prefix_caching=prefix,
                    prefill_graphs=graphs)  # fmt: skip
    add_engine_args(p, ["async_scheduling", "max_model_len"], async_scheduling=Flag(default=True),
                    max_model_len=Flag(default=8192))  # fmt: skip
    add_engine_args(p, ["model"], model=Flag(optional=True))
    args = p.parse_args(["--prefix-caching", "on,off"])
    assert (args.enable_prefix_caching, args.prefill_graphs, args.async_scheduling) == ("on,off", "off", True)
    assert (args.max_model_len, args.model) == (8192, None)
    text = " ".join(p.format_help().split())
    assert "on, off, or on,off (both, as arms) (default: off)" in text
    # The command's default replaces what the field says of its own.
    assert "context length: prompt plus output (default: 8192)" in text and "the model's" not in text
    assert "unless attention is flashinfer" not in text and "(default: True)" in text


def test_every_setting_is_checked_in_one_place_whoever_asks():
    with pytest.raises(Fp8InputError, match=r"^--block-size must be a power of two, got 12$"):
        check_setting("block_size", 12, "--block-size")
    with pytest.raises(Fp8InputError, match=r"^num_kv_blocks must be at least 2 \(one is scratch\), got 1$"):
        check_setting("num_kv_blocks", 1)
    check_setting("max_model_len", None)  # None: the model's own


def test_kernel_options_are_settings_that_the_load_applies(tmp_path, monkeypatch):
    from fp8route.kernels import options

    monkeypatch.setattr(options, "_current", [options.KernelOptions()])  # the process's own, back after
    monkeypatch.setattr(options, "_generation", [0])
    folder = text_model_folder(tmp_path / "m")
    fp8route.load_model(folder, device="cpu", max_num_seqs=1, quantize_upstream=False, quiet=True)
    assert options.kernel_options() == options.KernelOptions(pdl=False, quantize_upstream=False)
    fp8route.load_model(folder, device="cpu", max_num_seqs=1, quiet=True)  # None: as the process has them
    assert not options.kernel_options().quantize_upstream
    if options.why_not_pdl() is None:  # a Hopper GPU: the option applies
        EngineConfig(pdl=True).apply_kernel_options()
        assert options.kernel_options().pdl
    else:
        with pytest.raises(Fp8InputError, match="programmatic dependent launch: "):
            EngineConfig(pdl=True).apply_kernel_options()
