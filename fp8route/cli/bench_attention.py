"""`fp8route bench attention`: the paged attention kernel against the kernels the engine ran before it."""

from __future__ import annotations

import argparse

import torch

from fp8route.cli.sweep_args import cuda_device
from fp8route.errors import Fp8InputError
from fp8route.kernels import paged_decode as pd

# --sweep's tilings (query rows x positions x warps x stages); the first is paged_attention's default.
SWEEP_LAUNCHES = "128x128x8x3,128x128x8x2,256x128x8x2,256x64x8x3,128x64x8x3,128x32x4x3,64x64x4x3"


def run(args: argparse.Namespace) -> int:
    from fp8route.bench import attention as ab

    launches = ab.parse_launches(args.launches) if args.sweep else []
    decode_launches = {fp8: _decode_launches(args.decode_launches, fp8) for fp8 in (False, True)}
    if args.layers < 1:
        raise Fp8InputError(f"--layers must be at least 1, got {args.layers}")
    device = cuda_device(argparse.Namespace(device="cuda"))
    from fp8route.routing.fingerprint import Fingerprint

    print(f"bench attention on {Fingerprint.of(device).summary()}")
    if args.sweep:
        print("\n".join(ab.sweep(launches)))
        return 0
    print(
        "\n| prefill T | paged_attention us | SDPA us | cuDNN us | FlashInfer FA2 us | FlashInfer FA3 us "
        "| cuDNN / paged | paged TFLOP/s | best TFLOP/s |\n" + "|---" * 9 + "|"
    )
    for tokens in ab.PREFILL_TOKENS:
        t = ab.prefill(tokens)
        others = " | ".join("-" if us is None else f"{us:.0f}" for us in t[1:])
        best = min(us for us in t if us is not None)
        versus = "-" if t.cudnn is None else f"{t.cudnn / t.paged:.2f}"
        print(f"| {tokens} | {t.paged:.0f} | {others} | {versus} | {t.tflops(tokens, t.paged):.0f} "
              f"| {t.tflops(tokens, best):.0f} |", flush=True)  # fmt: skip
    for name, cache_dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        asked = decode_launches[cache_dtype == torch.float8_e4m3fn]
        names = " | ".join(f"decode {launch or 'default'} us" for launch in asked)
        print(f"\n| decode {name} | B | ctx | paged_attention us | {names} | new/old | KV TB/s |")
        print("|---" * (6 + len(asked)) + "|")
        for batch, ctx in ab.DECODE_CASES:
            paged_us, decode_us, tbs = ab.decode(batch, ctx, args.layers, cache_dtype, asked)
            times = " | ".join(f"{us:.1f}" for us in decode_us)
            ratio = paged_us / decode_us[0]
            print(f"| {name} | {batch} | {ctx} | {paged_us:.1f} | {times} | {ratio:.2f} | {tbs:.2f} |", flush=True)
    new, old = ab.mixed()
    print(f"\nmixed 255 decodes @1024 + 2048 fresh: paged_attention {new:.0f} us, decode kernel + SDPA {old:.0f} us")
    return 0


def _decode_launches(text: str, fp8: bool) -> list[pd.Launch | None]:
    """--decode-launches for one cache dtype: "default" (None) is decode_attention's own
    (paged_decode.LAUNCH for the cache's dtype); others as Launch.parse reads them."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    launches = [None if w == "default" else pd.Launch.parse(w) for w in words]
    if not launches:
        raise Fp8InputError(f"--decode-launches: one or more launches, comma-separated, got {text!r}")
    return launches


def register(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "attention",
        help="the paged attention kernel against the decode kernel and SDPA: decode, prefill, mixed (GPU)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=8, help="layer pools a decode graph cycles through")
    parser.add_argument("--sweep", action="store_true", help="time the multi-query grid's tilings (--launches) instead")
    parser.add_argument("--launches", default=SWEEP_LAUNCHES, help="tilings for --sweep: BLOCK_MxTILExWARPSxSTAGES,...")
    parser.add_argument(
        "--decode-launches", default="default",
        help="the decode kernel's launches to time, each against the first: BLOCKxWARPSxSTAGES[h], or default "
        "(its default per cache dtype)",
    )  # fmt: skip
    parser.set_defaults(run=run)
