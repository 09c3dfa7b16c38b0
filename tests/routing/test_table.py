"""Routing tables: bucket lookup, nearest shapes, sources, persistence, invalidation, corruption."""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from dataclasses import replace

import pytest
import torch
from routing_helpers import FP, H100, H200, only_core_backends, other, shape, table

import fp8route
from fp8route import M_BOUNDS, Fp8Linear, GemmProblem, Policy, make_plan
from fp8route.routing import Fingerprint, RoutingTable, RoutingTableError, load_table, read_table, save_table
from fp8route.routing.store import default_path, shipped_table
from fp8route.routing.table import MAX_NEAREST_DISTANCE


@pytest.fixture(autouse=True)
def core_backends(monkeypatch):
    only_core_backends(monkeypatch)


ROUTES = ["cublas_fast", "cublas", "rowwise", "rowwise"]  # M<=1, M 2-16, M 17-256, M>256


def problem(n=4096, k=4096, m_max=None, dtype=torch.bfloat16, device=H200) -> GemmProblem:
    return GemmProblem(n, k, device, out_dtype=dtype, m_max=m_max)


@pytest.mark.parametrize(
    ("m_max", "expected"),
    [
        (1, "cublas_fast"),
        (2, "cublas"),
        (16, "cublas"),
        (17, "rowwise"),
        (256, "rowwise"),
        (257, "rowwise"),
        (None, "rowwise"),
    ],
)
def test_bucket_lookup_follows_the_tables_bounds(m_max, expected):
    t = table(shape(4096, 4096, ROUTES))
    assert t(problem(m_max=m_max)) == expected


def test_plan_reads_the_table_once_and_forward_bisects():
    t = table(shape(4096, 4096, ROUTES))
    plan = make_plan("l", problem(), Policy(), t)
    got = {m: plan.backend_for(m, torch.bfloat16).name for m in (1, 2, 3, 16, 17, 200, 256, 257, 100_000)}
    assert got == {
        1: "cublas_fast",
        2: "cublas",
        3: "cublas",
        16: "cublas",
        17: "rowwise",
        200: "rowwise",
        256: "rowwise",
        257: "rowwise",
        100_000: "rowwise",
    }
    assert plan.bounds == M_BOUNDS
    assert plan.source.startswith("bfloat16: tuned; float16, float32: default priority for sm90")
    assert not plan.fallbacks


def test_a_tuned_route_that_cannot_run_is_a_reported_fallback():
    # rowwise writes bfloat16 only: a float16 table entry naming it falls back visibly.
    t = table(shape(4096, 4096, ROUTES, dtype=torch.float16))
    plan = make_plan("l", problem(dtype=torch.float16), Policy(), t)
    assert plan.backend_for(100, torch.float16).name == "cublas"
    assert any(f.wanted == "rowwise" and f.used == "cublas" for f in plan.fallbacks)


def test_nearest_shape_prefers_same_k_and_says_so():
    t = table(shape(6144, 4096, ["cublas_fast"] * 4), shape(4096, 8192, ["rowwise"] * 4))
    # 5120x4096: distance log2(6144/5120)=0.26 (same K) vs 0.32+1 to 4096x8192.
    assert t(problem(5120, 4096, m_max=1)) == "cublas_fast"
    assert make_plan("l", problem(5120, 4096), Policy(), t).source.startswith("bfloat16: nearest tuned shape 6144x4096")
    # Equal distance (a factor of 2 in N or in K): the same K wins.
    t2 = table(shape(8192, 4096, ["cublas_fast"] * 4), shape(4096, 8192, ["rowwise"] * 4))
    assert t2(problem(4096, 4096, m_max=1)) == "cublas_fast"


def test_far_shapes_get_the_default_priority():
    t = table(shape(4096, 4096, ROUTES))
    far = 4096 * 2 ** (MAX_NEAREST_DISTANCE + 0.5)
    assert t(problem(int(far), 4096, m_max=1)) is None
    assert t(problem(4096, 512, m_max=1)) is None
    assert make_plan("l", problem(4096, 512), Policy(), t).source.startswith("default priority for sm90; routing table")


def test_nearest_shape_only_offers_what_this_shape_can_run():
    # 4104 is not a multiple of 16: the nearest shape's cuBLAS winner cannot run it.
    t = table(shape(4096, 4096, ["cublas"] * 4))
    assert t(problem(4104, 4096, m_max=1)) is None


def test_table_of_another_gpu_does_not_steer_and_explain_says_why():
    t = table(shape(4096, 4096, ROUTES))
    assert t(problem(device=H100, m_max=1)) is None
    plan = make_plan("l", problem(device=H100), Policy(), t)
    assert "is for NVIDIA H200, not this device" in plan.source
    assert {b.name for b in plan.routes[torch.bfloat16]} == {"cublas"}


def test_json_round_trip(tmp_path):
    t = table(shape(4096, 4096, ROUTES, times={"cublas": [9.0, None, 30.0], "rowwise": [12.0, 20.0, 25.0]}))
    saved = save_table(t, tmp_path / "t.json")
    back = read_table(tmp_path / "t.json")
    assert back.to_json() == t.to_json() == saved.to_json()
    assert back.fingerprint == FP
    assert back.shapes[(4096, 4096, torch.bfloat16, False, "tensor")].timings["cublas"][1] is None
    assert "routing table" in back.origin


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{",
        "[]",
        '{"format": "something else"}',
        json.dumps({"format": "fp8route-routing-table", "version": 99}),
        json.dumps({"format": "fp8route-routing-table", "version": 1, "fingerprint": {}}),
    ],
)
def test_corrupt_files_are_warnings_not_crashes(tmp_path, caplog, text):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(RoutingTableError):
        read_table(path)
    with caplog.at_level(logging.WARNING, logger="fp8route"):
        assert load_table(path=path, fingerprint=FP, defaults_dir=tmp_path / "none") is None
    assert "ignoring" in caplog.text and "fp8route tune" in caplog.text


def test_every_malformed_field_is_a_table_error(tmp_path):
    good = table(shape(4096, 4096, ROUTES)).to_json()
    breakages = [
        ("m_bounds", [4, 2]),
        ("m_bounds", "1,2"),
        ("shapes", [{"n": "4096"}]),
        ("shapes", [{**good["shapes"][0], "routes": ["cublas"]}]),  # type: ignore[index]
        ("shapes", [{**good["shapes"][0], "dtype": "int8"}]),  # type: ignore[index]
        ("shapes", [{**good["shapes"][0], "median_us": {"cublas": [1.0]}}]),  # type: ignore[index]
        ("shapes", [{**good["shapes"][0], "median_us": {"cublas": ["x", 1, 2]}}]),  # type: ignore[index]
        ("fingerprint", {**FP.to_json(), "sm_count": "132"}),
    ]
    for key, value in breakages:
        with pytest.raises(RoutingTableError):
            RoutingTable.from_json({**good, key: value})


def test_table_from_another_device_or_version_is_rejected_with_a_warning(tmp_path, caplog):
    path = tmp_path / "t.json"
    save_table(table(shape(4096, 4096, ROUTES), fingerprint=other(cublas="120900")), path)
    with caplog.at_level(logging.WARNING, logger="fp8route"):
        assert load_table(path=path, fingerprint=FP, defaults_dir=tmp_path / "none") is None
    assert "cublas '120900' vs '130100'" in caplog.text and "re-run `fp8route tune`" in caplog.text.lower()
    save_table(table(shape(4096, 4096, ROUTES), fingerprint=other(gpu="NVIDIA H100 80GB HBM3")), path, merge=False)
    assert load_table(path=path, fingerprint=FP, defaults_dir=tmp_path / "none") is None
    save_table(table(shape(4096, 4096, ROUTES)), path, merge=False)
    assert load_table(path=path, fingerprint=FP, defaults_dir=tmp_path / "none") is not None


def test_shipped_defaults_need_the_same_gpu_only_and_say_what_they_were_measured_with(tmp_path, caplog):
    defaults = tmp_path / "defaults"
    defaults.mkdir()
    (defaults / "broken.json").write_text("{")
    save_table(table(shape(4096, 4096, ROUTES), fingerprint=other(gpu="NVIDIA H100 80GB HBM3")), defaults / "h100.json")
    save_table(table(shape(4096, 4096, ROUTES), fingerprint=other(torch="2.9.0")), defaults / "h200.json")
    # A stale user table is ignored; the shipped one for this GPU is used instead.
    user = tmp_path / "user.json"
    save_table(table(shape(4096, 4096, ROUTES), fingerprint=other(fp8route="0.0.1")), user)
    with caplog.at_level(logging.WARNING, logger="fp8route"):
        got = load_table(path=user, fingerprint=FP, defaults_dir=defaults)
    assert got is not None and got.origin.startswith("shipped defaults h200.json, measured with torch 2.9.0")
    assert "broken.json" in caplog.text
    assert shipped_table(other(gpu="NVIDIA B200"), defaults) is None
    assert load_table(fingerprint=other(gpu="cpu", capability=""), defaults_dir=defaults) is None


def test_the_package_may_ship_no_defaults_yet():
    assert shipped_table(other(gpu="no such GPU")) is None


def test_default_path_honours_env_and_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("FP8ROUTE_TABLE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_path(FP) == tmp_path / "fp8route" / "routing-h200.json"
    monkeypatch.setenv("FP8ROUTE_TABLE", str(tmp_path / "mine.json"))
    assert default_path(FP) == tmp_path / "mine.json"


def test_load_prefers_a_matching_user_table(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("FP8ROUTE_TABLE", raising=False)
    save_table(table(shape(4096, 4096, ROUTES)), default_path(FP))
    got = load_table(fingerprint=FP, defaults_dir=tmp_path / "none")
    assert got is not None and got(problem(m_max=1)) == "cublas_fast"


def test_save_merges_with_a_table_of_the_same_fingerprint(tmp_path, caplog):
    path = tmp_path / "t.json"
    save_table(table(shape(4096, 4096, ROUTES), shape(6144, 4096, ["cublas"] * 4)), path)
    merged = save_table(table(shape(6144, 4096, ["rowwise"] * 4)), path)
    assert set(merged.shapes) == {
        (4096, 4096, torch.bfloat16, False, "tensor"),
        (6144, 4096, torch.bfloat16, False, "tensor"),
    }
    assert read_table(path).shapes[(6144, 4096, torch.bfloat16, False, "tensor")].routes[0] == "rowwise"
    with caplog.at_level(logging.WARNING, logger="fp8route"):
        replaced = save_table(table(shape(8192, 4096, ["cublas"] * 4), fingerprint=other(torch="9.9")), path)
    assert (
        set(replaced.shapes) == {(8192, 4096, torch.bfloat16, False, "tensor")} and "measured elsewhere" in caplog.text
    )


def _writer(path: str, n: int, rounds: int) -> None:
    from routing_helpers import shape as make_shape
    from routing_helpers import table as make_table

    from fp8route.routing import save_table as save

    for i in range(rounds):
        # Big enough that a torn write would be caught mid-file by a reader.
        shapes = [make_shape(n, 16 * (j + 1), ["cublas"] * 4) for j in range(40)]
        shapes.append(make_shape(n, 16 * 1000 + i, ["cublas"] * 4))
        save(make_table(*shapes), path)


def test_concurrent_writers_never_leave_a_torn_file_and_keep_each_others_shapes(tmp_path):
    path = tmp_path / "t.json"
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_writer, args=(str(path), n, 25)) for n in (4096, 6144)]
    for w in writers:
        w.start()
    reads = 0
    deadline = time.monotonic() + 60
    while any(w.is_alive() for w in writers) and time.monotonic() < deadline:
        if path.exists():
            read_table(path)  # raises on a torn file
            reads += 1
    for w in writers:
        w.join(timeout=max(1.0, deadline - time.monotonic()))
        assert w.exitcode == 0
    final = read_table(path)
    assert {key[0] for key in final.shapes} == {4096, 6144}
    last = 16 * 1000 + 24
    assert (4096, last, torch.bfloat16, False, "tensor") in final.shapes and (
        6144,
        last,
        torch.bfloat16,
        False,
        "tensor",
    ) in final.shapes
    assert not list(tmp_path.glob("*.tmp"))
    assert reads > 0


def test_route_replans_every_layer_and_explain_shows_the_source():
    layers = torch.nn.Sequential(
        *(Fp8Linear.from_float(torch.nn.Linear(64, 32), input_scale=0.01, name=f"l{i}") for i in range(2))
    )
    t = table(shape(32, 64, ["cublas"] * 4))
    assert fp8route.route(layers, t) is layers
    assert all(layer.preference is t for layer in layers)
    # On this CPU the H200 table does not apply, and explain says so.
    assert "routing table in memory is for NVIDIA H200, not this device" in fp8route.explain(layers)
    # What the same layer would run on the H200 the table was measured on:
    plan = layers[0].replan(device=H200)
    assert plan.backend_for(1, torch.bfloat16).name == "cublas" and plan.source.startswith("bfloat16: tuned")


def test_route_without_a_table_on_cpu_leaves_layers_alone():
    layer = Fp8Linear.from_float(torch.nn.Linear(64, 32), input_scale=0.01)
    before = layer.plan
    fp8route.route(torch.nn.Sequential(layer))
    assert layer.plan is before


def test_fingerprint_of_this_process_and_its_json():
    cpu = Fingerprint.of("cpu")
    assert cpu.capability == "" and cpu.torch == torch.__version__ and cpu.fp8route == fp8route.__version__
    assert load_table("cpu") is None
    assert Fingerprint.from_json(FP.to_json()) == FP
    assert other(gpu="NVIDIA H100 80GB HBM3").slug == "h100-80gb-hbm3" and FP.slug == "h200"
    assert FP.differences(other(cuda="12.8", triton="3.4.0")) == ["cuda '13.0' vs '12.8'", "triton '3.5.0' vs '3.4.0'"]
    assert FP.differences(other(cuda="12.8"), only=("gpu", "capability")) == []
    with pytest.raises(ValueError, match="lacks"):
        Fingerprint.from_json({"gpu": "x"})


def test_fingerprint_of_a_cuda_device_reads_every_field(monkeypatch):
    import contextlib
    from types import SimpleNamespace

    props = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, L2_cache_size=62914560)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "current_blas_handle", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    fp = Fingerprint.of(torch.device("cuda", 0))
    assert (fp.gpu, fp.capability, fp.sm_count, fp.l2_bytes) == ("NVIDIA H200", "9.0", 132, 62914560)
    assert fp.driver and fp.cublas and fp.cuda and fp.torch == torch.__version__


def test_pre_quantized_input_has_routes_of_its_own_or_takes_the_float_ones():
    float_routes = shape(4096, 4096, ROUTES)
    fp8_routes = replace(shape(4096, 4096, ["cublas", "cublas", "cublas", "cublas_fast"]), x_quantized=True)
    both = table(float_routes, fp8_routes)
    xq = replace(problem(m_max=1), x_quantized=True)
    assert both(problem(m_max=1)) == "cublas_fast" and both(xq) == "cublas"
    assert table(float_routes)(xq) == "cublas_fast"  # no routes of its own: the float-input ones
    assert both.describe(problem()).startswith("bfloat16: tuned; float16, float32: default priority for sm90; ")
    assert "x pre-quantized bfloat16: tuned" in both.describe(problem())
    assert "x pre-quantized" not in table(float_routes).describe(problem())

    plan = make_plan("l", problem(), Policy(), both)
    assert plan.backend_for(1, torch.bfloat16).name == "cublas_fast"
    assert plan.backend_for(1, torch.bfloat16, x_quantized=True).name == "cublas"
    assert plan.backend_for(10_000, torch.bfloat16, x_quantized=True).name == "cublas_fast"
    text = plan.explain()
    assert "x pre-quantized -> bfloat16: M 1-256 -> cublas; M 257+ -> cublas_fast" in text
    same = make_plan("l", problem(), Policy(), table(float_routes)).explain()
    assert "x pre-quantized (forward_quantized): the same" in same


def test_pre_quantized_entries_survive_json_and_version_1_files_still_read(tmp_path):
    fp8_routes = replace(shape(4096, 4096, ["cublas"] * 4), x_quantized=True)
    t = table(shape(4096, 4096, ROUTES), fp8_routes)
    path = tmp_path / "t.json"
    save_table(t, path)
    doc = json.loads(path.read_text())
    assert doc["version"] == 3 and sorted(s["x"] for s in doc["shapes"]) == ["float", "fp8"]
    back = read_table(path)
    assert set(back.shapes) == {
        (4096, 4096, torch.bfloat16, False, "tensor"),
        (4096, 4096, torch.bfloat16, True, "tensor"),
    }
    doc["version"] = 1
    for s in doc["shapes"]:
        del s["x"], s["scheme"]
    doc["shapes"] = doc["shapes"][:1]
    path.write_text(json.dumps(doc))
    assert set(read_table(path).shapes) == {(4096, 4096, torch.bfloat16, False, "tensor")}
    doc["shapes"][0]["x"] = "int8"
    doc["version"] = 2
    path.write_text(json.dumps(doc))
    with pytest.raises(RoutingTableError, match='x must be "float" or "fp8"'):
        RoutingTable.from_json(json.loads(path.read_text()), origin=str(path))


def test_forward_quantized_runs_the_pre_quantized_route(monkeypatch):
    from helpers import random_fp8_operands

    ops = random_fp8_operands(3, 64, 32, seed=1)
    layer = Fp8Linear(ops["weight"], ops["weight_scale"], ops["input_scale"], name="l")
    t = table(shape(64, 32, ["cublas"] * 4), replace(shape(64, 32, ["cublas_fast"] * 4), x_quantized=True))
    layer.replan(preference=t, device=H200)
    ran: list[str] = []
    for name in ("cublas", "cublas_fast"):
        backend = fp8route.BACKENDS[name]
        run = backend.run_quantized
        monkeypatch.setattr(backend, "run_quantized", lambda *a, name=name, run=run: ran.append(name) or run(*a))
    x = ops["x"].to(torch.bfloat16)
    layer(x)
    layer.forward_quantized(fp8route.quant.quantize(x, layer.input_scale), torch.bfloat16)
    assert ran == ["cublas", "cublas_fast"]


def test_a_pre_quantized_route_that_cannot_run_is_its_own_reported_fallback():
    # rowwise writes bfloat16 only: a float16 entry for pre-quantized x naming it falls back, and
    # the fallback says which input it is on; the float-input routes are untouched.
    fp8_only = replace(shape(4096, 4096, ROUTES, dtype=torch.float16), x_quantized=True)
    plan = make_plan("l", problem(dtype=torch.float16), Policy(), table(fp8_only))
    assert plan.backend_for(100, torch.float16, x_quantized=True).name == "cublas"
    bad = [f for f in plan.fallbacks if f.wanted == "rowwise"]
    assert bad and all(f.x_quantized and f.used == "cublas" for f in bad)
    assert "x pre-quantized float16 M 17+: rowwise -> cublas (writes bfloat16 output only)" in plan.explain()


@pytest.mark.parametrize(
    ("name", "gpu", "tps"), [("h200.json", "NVIDIA H200", (1, 4)), ("h100.json", "NVIDIA H100 80GB HBM3", (1,))]
)
def test_a_shipped_table_covers_llama_8b_and_names_only_known_backends(name: str, gpu: str, tps: tuple[int, ...]):
    from importlib.resources import files

    from fp8route.models.shapes import model_shapes

    doc = json.loads(files("fp8route.routing.defaults").joinpath(name).read_text())
    shipped = RoutingTable.from_json(doc, origin=name)
    assert shipped.fingerprint.gpu == gpu
    for tp in tps:
        for s in model_shapes("llama-3.1-8b", tp=tp):
            assert (s.n, s.k, torch.bfloat16, False, "tensor") in shipped.shapes, (tp, s)
    for s in model_shapes("llama-3.1-8b", tp=1):
        assert (s.n, s.k, torch.bfloat16, True, "tensor") in shipped.shapes, s
    named = {r for entry in shipped.shapes.values() for r in entry.routes}
    assert named <= set(fp8route.BACKENDS) and None not in named


def test_entries_are_per_scheme_and_a_layer_takes_only_its_schemes_routes(tmp_path):
    block = replace(shape(4096, 4096, ["triton_block"] * 4), scheme="block")
    t = table(shape(4096, 4096, ROUTES), block)
    path = tmp_path / "t.json"
    save_table(t, path)
    back = read_table(path)
    assert {s.scheme for s in back.shapes.values()} == {"tensor", "block"}
    problem = GemmProblem(4096, 4096, H200, static_input_scale=False, scheme="block", m_max=1)
    assert back(problem) == "triton_block"
    channel = GemmProblem(4096, 4096, H200, static_input_scale=False, scheme="channel", m_max=1)
    assert back(channel) is None  # no channel entry: the default priority, not a tensor-scheme route
    doc = json.loads(path.read_text())
    doc["shapes"][0]["scheme"] = "mxfp8"
    path.write_text(json.dumps(doc))
    with pytest.raises(RoutingTableError, match="unknown scheme 'mxfp8'"):
        read_table(path)
