"""The outputs: `peers.json` (every number), `peers.md` (the table) and `peers.png` (bars)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _cell(row: dict[str, Any], i: int, first: bool, last: bool) -> str:
    m = row["measurements"][i] if i < len(row["measurements"]) else None
    if m is None or not m["ok"]:
        return "failed" if m is not None else "—"
    text = f"{m['output_tok_s']:.1f}"
    if m["ok"] < m["prompts"]:
        text += f" ({m['prompts'] - m['ok']} failed)"
    if first:
        text += f" ({m['tpot_ms']:.1f})"
    elif last:
        text += f" ({m['ttft_p50_ms']:.0f})"
    return text


def _per_conc(values: list[str]) -> str:
    return " / ".join(values)


def _tok_s(row: dict[str, Any], i: int) -> float | None:
    ms = row["measurements"]
    return ms[i]["output_tok_s"] if i < len(ms) and ms[i]["ok"] else None


def _read_note(meta: dict[str, Any]) -> str:
    """How the memory read was measured: by page size where the run measured both."""
    pages = meta.get("bandwidth_by_page_gb_s")
    if not pages:  # (runs before the page sizes were measured apart)
        return "256 MB torch sum, 2 threads"
    return ("the faster of a 256 MB torch sum, 2 threads, on each page size: "
            + ", ".join(f"{v:.1f} on {k} pages" for k, v in pages.items()))


def markdown(data: dict[str, Any]) -> str:
    meta, rows, concs = data["meta"], data["rows"], data["meta"]["concurrency"]
    vllm = next((r for r in rows if r["kind"] == "vllm" and not r["error"]), None)
    heads = [f"conc {c} tok/s" for c in concs]
    heads[0] += " (TPOT ms)"
    heads[-1] += " (TTFT p50 ms)"
    slash = " / ".join(str(c) for c in concs)
    lines = [
        f"# ringserve and its peers on {meta['model']}" + (" (quick run)" if meta["quick"] else ""),
        "",
        f"{meta['date']}; {meta['machine']}; memory read {meta['bandwidth_gb_s']:.1f} GB/s "
        f"({_read_note(meta)}). Each server alone on the machine, started, loaded "
        "and stopped in turn. Load: `benchmarks/serve_bench.py`, "
        f"{meta['input_len']} random prompt token ids, {meta['output_len']} output tokens, "
        + ("greedy" if not meta.get("temperature") else
           f"temperature {meta['temperature']:g} (sampled)")
        + ", ignore_eos, streaming; prompts per concurrency "
        f"{' / '.join(str(p) for p in meta['prompts'])}, each after a warm-up of as many "
        "short requests as the concurrency (16 prompt, 8 output tokens). Output tok/s = "
        "generated tokens / wall time of the load; TPOT and TTFT are medians."
        + (f" Every number is the median of {meta['rounds']} rounds; each round starts, loads "
           "and stops every server in turn, in alternating order (per-round output tok/s "
           "below)." if meta.get("rounds", 1) > 1 else ""),
        "",
        "| server | " + " | ".join(heads) + f" | vs vLLM ({slash}) | read limit tok/s ({slash}) "
        f"| achieved / limit ({slash}) | others' CPU ({slash}) |",
        "|---" * (len(concs) + 5) + "|",
    ]
    for row in rows:
        if row["error"] and not row["measurements"]:
            reason = row["error"].splitlines()[0][:120].replace("|", "/")
            lines.append(f"| {row['name']} | failed: {reason} |" + " — |" * (len(concs) + 3))
            continue
        cells = [_cell(row, i, i == 0, i == len(concs) - 1) for i in range(len(concs))]
        ratios, achieved = [], []
        for i in range(len(concs)):
            mine = _tok_s(row, i)
            ref = _tok_s(vllm, i) if vllm else None
            ratios.append(f"{mine / ref:.2f}" if mine and ref else "n/a")
            # NOTE: no ceiling when a server's start-up log did not say its weight bytes
            achieved.append(f"{mine / row['ceilings'][i]:.2f}"
                            if mine and row["ceilings"] else "n/a")
        limits = [f"{c:.0f}" for c in row["ceilings"]] or ["n/a"] * len(concs)
        others = [f"{m['others_cpu']:.0%}" for m in row["measurements"]]
        lines.append(f"| {row['name']} | " + " | ".join(cells) + f" | {_per_conc(ratios)} | "
                     f"{_per_conc(limits)} | {_per_conc(achieved)} | {_per_conc(others)} |")
    lines += ["", "Read limit: concurrency x bandwidth / (weight bytes + concurrency x "
              f"{meta['context_tokens']} tokens x KV bytes per token), i.e. a step that costs "
              "only its memory reads. Weight bytes: parameters "
              f"({meta['parameters']:,}) x 2 (bf16) or x 4 (float32); for a GGUF its file size; "
              "for ringserve what its start-up log says a decode step reads. "
              "Others' CPU: the share of all CPUs that processes other than the server and the "
              "load generator used during the load (each load first waits, up to "
              f"{meta['quiet_wait']:.0f} s, for that share to fall under 15%, and is measured "
              "again when it exceeded 10% during the load).",
              "", "| server | weights read per step | load average before | command |",
              "|---|---|---|---|"]
    for row in rows:
        load = " ".join(f"{x:.2f}" for x in row["load_average"])
        weights = (f"{row['weight_bytes'] / 1e6:.0f} MB ({row['weights']})"
                   if row["weight_bytes"] else "—")
        command = f"`{row['command']}`" if row["command"] else "—"
        lines.append(f"| {row['name']} | {weights} | {load} | {command} |")
    if meta.get("rounds", 1) > 1:
        lines += ["", f"Output tok/s of each round ({slash}):", ""]
        for row in rows:
            per = [" / ".join(f"{x['output_tok_s']:.1f}" for x in m.get("rounds", []))
                   for m in row["measurements"]]
            lines.append(f"- {row['name']}: " + "; ".join(
                f"conc {c}: {p}" for c, p in zip(concs, per, strict=False)))
    failures = [r for r in rows if r["error"]]
    if failures:
        lines += ["", "Failures:", ""]
        lines += [f"- {r['name']}: `{r['error'].splitlines()[0][:300]}`" for r in failures]
    lines += ["", f"Made by `{meta['invocation']}` at commit {meta['commit']}.", ""]
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    concs, rows = data["meta"]["concurrency"], data["rows"]
    width = 0.8 / max(1, len(rows))
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for j, row in enumerate(rows):
        xs = [i + (j - (len(rows) - 1) / 2) * width for i in range(len(concs))]
        values = [_tok_s(row, i) or 0.0 for i in range(len(concs))]
        label = row["name"] + ("" if any(values) else " (failed)")
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, labels=[f"{v:.0f}" if v else "" for v in values], fontsize=7)
        if row["ceilings"] and any(values):
            ax.hlines(row["ceilings"], [x - width / 2 for x in xs], [x + width / 2 for x in xs],
                      colors="black", linestyles="dashed", linewidth=1)
    ax.set_xticks(range(len(concs)), [f"concurrency {c}" for c in concs])
    if any(_tok_s(row, i) for row in rows for i in range(len(concs))):
        ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 3.0, 5.0)))
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="both", labelsize=8)
    ax.set_ylabel("output tokens / s (log scale)")
    ax.set_title(f"{data['meta']['model']}, {data['meta']['machine']}: output throughput "
                 "(dashed: memory-read limit)", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.07), ncol=len(rows))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(data: dict[str, Any], prefix: Path) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    prefix.with_suffix(".md").write_text(markdown(data))
    try:
        import matplotlib  # noqa: F401 (only to know whether the plot can be drawn)
    except ImportError:  # `make bench-peers` installs it; `python benchmarks/peers/run.py` may not
        print(f"no plot: matplotlib is not installed (the table is {prefix.with_suffix('.md')})")
        return
    plot(data, prefix.with_suffix(".png"))
