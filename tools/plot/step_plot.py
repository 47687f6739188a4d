"""Draws a `latentkv step` report: the step of each strategy as stacked bars by op, and each op's
time against its floor.

    python3 step_plot.py REPORT.json OUT.png|OUT.svg

The latentkv binary embeds this file and runs it as `python3 - REPORT.json OUT` (`latentkv step
--plot OUT`, or `latentkv step --from-json REPORT.json --plot OUT` to redraw a saved run).
Exit status: 0 drawn, 2 bad arguments, 3 matplotlib missing, 1 anything else.
"""
import json
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit(3)

# One colour per op, the same in both panels.
OP_COLOURS = {
    "append": "#8c8c8c",
    "indexer_logits": "#4c72b0",
    "topk": "#dd8452",
    "sparse_decode": "#55a868",
    "dense_decode": "#c44e52",
}
BETWEEN_COLOUR = "#e0e0e0"


def layers_text(n):
    return "1 layer" if n == 1 else "%d layers" % n


def label_of(strategy):
    return "%s\n(%s, %s)" % (strategy["name"], strategy["path"], strategy["backend"])


def gap_text(gap):
    return ("%.0fx" if gap >= 100 else "%.1fx") % gap


def draw_step_bars(ax, report, strategies):
    """Panel 1: one bar per strategy, its ops stacked, in ms per step. When one strategy (cast_full,
    typically) is many times slower than the rest, the axis stops above the others and that bar is
    marked off scale, so that the fast strategies' stacks stay readable."""
    totals = [max(s["step_us"], s["ops_us"]) / 1000.0 for s in strategies]
    ordered = sorted(totals)
    top = ordered[-1] * 1.2
    if len(ordered) > 1 and ordered[-1] > 4 * ordered[-2]:
        top = ordered[-2] * 1.6
    shown = set()
    for x, s in enumerate(strategies):
        bottom = 0.0
        for op in s["ops"]:
            ms = op["us"] / 1000.0
            name = op["op"]
            ax.bar(x, ms, bottom=bottom, color=OP_COLOURS.get(name, "#999999"),
                   label=name if name not in shown else None, edgecolor="white", linewidth=0.5)
            shown.add(name)
            bottom += ms
        between = (s["step_us"] - s["ops_us"]) / 1000.0
        if between > 0:
            ax.bar(x, between, bottom=bottom, color=BETWEEN_COLOUR, hatch="//", edgecolor="#b0b0b0",
                   label="between ops" if "between" not in shown else None, linewidth=0.5)
            shown.add("between")
        text = "%.3g ms" % (s["step_us"] / 1000.0)
        if (s.get("tokens_per_s_stream") or 0) > 0:  # null: not measured
            text += "\n%.0f tok/s" % s["tokens_per_s_stream"]
        if totals[x] > top:
            ax.annotate(text + "\n(off scale)", (x, top), ha="center", va="top", fontsize=8, fontweight="bold",
                        xytext=(0, -4), textcoords="offset points",
                        bbox=dict(boxstyle="round", facecolor="white", alpha=0.9))
        else:
            ax.annotate(text, (x, totals[x]), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                        textcoords="offset points")
    ax.set_xticks(range(len(strategies)))
    ax.set_xticklabels([label_of(s) for s in strategies], fontsize=8)
    layers = report["shape"]["layers"]
    ax.set_ylabel("ms per step (%s%s)" % ("" if layers == 1 else "all ", layers_text(layers)))
    clock = "host wall-clock, CPU reference" if report.get("cpu_reference") else "CUDA graph replay, median"
    ax.set_title("the step by op (%s)" % clock, fontsize=10)
    ax.set_ylim(0, top)
    ax.grid(axis="y", alpha=0.3)


def draw_floors(ax, report, strategies):
    """Panel 2: per op, each strategy's time next to the op's floor (log scale)."""
    ops = []
    for s in strategies:
        for op in s["ops"]:
            if op["op"] not in ops:
                ops.append(op["op"])
    width = 0.8 / max(len(strategies), 1)
    has_floor = False
    for k, s in enumerate(strategies):
        by_op = {op["op"]: op for op in s["ops"]}
        for i, name in enumerate(ops):
            op = by_op.get(name)
            if op is None or (op["us"] or 0) <= 0:
                continue
            x = i - 0.4 + width * (k + 0.5)
            ax.bar(x, op["us"], width=width * 0.9, color=OP_COLOURS.get(name, "#999999"),
                   alpha=0.35 + 0.65 * (k + 1) / len(strategies), edgecolor="black", linewidth=0.3)
            label = s["name"]
            if (op.get("floor_us") or 0) > 0:  # null: no floor without the ceilings
                has_floor = True
                ax.hlines(op["floor_us"], x - width * 0.45, x + width * 0.45, colors="black", linewidth=1.5)
                label += "  " + gap_text(op["gap"])
            ax.annotate(label, (x, op["us"]), rotation=90, ha="center", va="bottom", fontsize=6,
                        xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(ops)))
    ax.set_xticklabels(ops, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("us per step (log)")
    if has_floor:
        # The floor's terms as the report measured them (a term it lacks is not in its floor either).
        terms = []
        if report.get("copy_gbps"):
            terms.append("bytes / %.0f GB/s copy" % report["copy_gbps"])
        if report.get("matrix_tflops"):
            terms.append("FLOP / %.0f TFLOP/s bf16" % report["matrix_tflops"])
        if report.get("launch_us"):
            terms.append("%s x %.2f us chained launch" % (layers_text(report["shape"]["layers"]), report["launch_us"]))
        ax.set_title("each op against its floor (black line): max(%s);\nlabels: strategy and gap = time / floor"
                     % ", ".join(terms), fontsize=8)
    else:
        ax.set_title("each op's time (no floors: the CPU reference is not a speed claim)", fontsize=10)
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * 30)  # room for the labels above the bars
    ax.grid(axis="y", alpha=0.3)


def main(argv):
    if len(argv) != 3 or not (argv[2].endswith(".png") or argv[2].endswith(".svg")):
        print("usage: step_plot.py REPORT.json OUT.png|OUT.svg", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        report = json.load(f)
    strategies = [s for s in report["strategies"] if s["timed"]]
    if not strategies:
        print("step_plot: no strategy was timed in %s: nothing to draw" % argv[1], file=sys.stderr)
        return 1
    shape = report["shape"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [1, 1.3]})
    draw_step_bars(left, report, strategies)
    draw_floors(right, report, strategies)
    # One legend for both panels: the colours are the ops'.
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.suptitle("latentkv step: %s tp %d (%d heads), %s, batch %d x q_len %d, context %d, pool %d; %s"
                 % (shape["model"], shape["tp"], shape["heads"], layers_text(shape["layers"]), shape["batch"],
                    shape["q_len"], shape["context"], shape["pool_tokens"], report["device"]), fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    fig.savefig(argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
