"""`bench decode`'s text summary and plot, from the JSON it writes (so an old run can be read again)."""

from __future__ import annotations

from pathlib import Path

from fp8route.bench.decode import ARM_ORDER, SHAPES


def timings_tie(a: dict, b: dict) -> bool:
    """Two arms tie when their gap is inside the larger rep-to-rep spread of the two."""
    gap = abs(a["median_us"] - b["median_us"]) / max(a["median_us"], b["median_us"])
    return gap <= max(a["spread"], b["spread"])


def summarize(result: dict) -> str:
    lines = [
        f"copy bandwidth {result['copy_gbs']:.0f} GB/s, empty kernel {result['empty_kernel_us']:.2f} µs"
        f" (in a graph {result['empty_kernel_graph_us']:.2f} µs); cold L2 by rotation"
    ]
    for mode, how in (("events", "per call, 2 reps"), ("graph", "per call, 2 reps x graph replays")):
        rows = [r for r in result["rows"] if r["timing"] == mode]
        if rows:
            lines += [f"-- timing: {mode} ({how})", *_table(rows), *_tp1_sums(rows)]
    return "\n".join(lines)


def _table(rows: list[dict]) -> list[str]:
    by = {(r["shape"], r["m"], r["arm"]): r for r in rows}
    arms = sorted({r["arm"] for r in rows}, key=ARM_ORDER.index)
    lines = [
        f"{'shape':12s} {'M':>4s} "
        + " ".join(f"{a:>13s}" for a in arms)
        + f" {'floor':>7s} {'%bw ours':>8s} {'x vs cub+q':>10s}"
    ]
    for shape in SHAPES:
        for m in sorted({r["m"] for r in rows if r["shape"] == shape}):
            ours, cublas_q = by[(shape, m, "ours")], by[(shape, m, "cublas+quant")]
            times = " ".join(
                f"{by[(shape, m, a)]['median_us'] if (shape, m, a) in by else float('nan'):13.2f}" for a in arms
            )
            lines.append(
                f"{shape:12s} {m:4d} {times} {ours['floor_us']:7.2f} {ours['pct_copy_bw']:7.1f}%"
                f" {cublas_q['median_us'] / ours['median_us']:9.2f}x" + (" tie" if timings_tie(ours, cublas_q) else "")
            )  # fmt: skip
    return lines


def _tp1_sums(rows: list[dict]) -> list[str]:
    """Llama-3.1-8B's TP1 layer sum at M=1 and 16, per arm that ran every TP1 shape."""
    by = {(r["shape"], r["m"], r["arm"]): r for r in rows}
    tp1 = [s for s in SHAPES if s.startswith("tp1")]
    lines = []
    for m in (1, 16):
        arms = [a for a in ARM_ORDER if all((s, m, a) in by for s in tp1)]
        if "ours" not in arms or "cublas+quant" not in arms:
            continue
        sums = {a: sum(by[(s, m, a)]["median_us"] for s in tp1) for a in arms}
        floor = sum(by[(s, m, "ours")]["floor_us"] for s in tp1)
        lines.append(
            f"Llama-3.1-8B TP1 sum M={m}: " + ", ".join(f"{a} {v:.1f}" for a, v in sums.items())
            + f", floor {floor:.1f} µs; ours is {sums['cublas+quant'] / sums['ours']:.2f}x cublas+quant"
        )  # fmt: skip
    return lines


def plot(result: dict, path: Path) -> None:
    """µs against M per shape and arm, with the floor (matplotlib, the plot extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["timing"] == "events"]
    shapes = [s for s in SHAPES if any(r["shape"] == s for r in rows)]
    fig, axes = plt.subplots(-(-len(shapes) // 4), 4, figsize=(20, 4.5 * -(-len(shapes) // 4)), squeeze=False)
    for ax, shape in zip(axes.flat, shapes, strict=False):
        for arm in sorted({r["arm"] for r in rows}, key=ARM_ORDER.index):
            pts = sorted((r["m"], r["median_us"]) for r in rows if r["shape"] == shape and r["arm"] == arm)
            ax.plot(*zip(*pts, strict=True), marker="o", label=arm)
        floor = sorted((r["m"], r["floor_us"]) for r in rows if r["shape"] == shape and r["arm"] == "ours")
        ax.plot(*zip(*floor, strict=True), "k--", label="floor (bytes / copy bw)")
        n, k = SHAPES[shape]
        ax.set(xscale="log", title=f"{shape} N={n} K={k}", xlabel="M", ylabel="µs", ylim=(0, None))
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fp = result["fingerprint"]
    fig.suptitle(f"FP8 decode linears, {fp['gpu']}, torch {fp['torch']}, triton {fp['triton']}, cold L2 by rotation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
