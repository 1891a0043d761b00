"""The docs' generated tables, rendered from the benchmarks' results files (benchmarks/results/*.json): the
what-if's accuracy (docs/accuracy.md, from `benchmarks/predict_accuracy.py --out`), the refusal's time and the
public programs' pre-flight (docs/preflight.md, from `benchmarks/refusal_time.py --out` and
`benchmarks/public_programs.py --out`).

    python benchmarks/doc_tables.py            # print every block
    python benchmarks/doc_tables.py --write    # write each into its page, between its markers

A page's generated block is this module's output and nothing else: tests/unit/test_accuracy_page.py renders the
committed results files and compares. A new run of a benchmark refreshes its page with one command; a hand edit of
a block fails the test.

Scores, per basis (analytic: the model's parts, no extra run; calibrated: what `predict(..., calibrate=True)` gives,
the step replay where its self-check passed):
- the error of each point against the median of its fresh runs;
- band coverage: the median lies within the band printed beside the prediction (peak x (1 ± band), its low side
  wider where the prediction says so: WhatIf.below);
- xMem's three figures (arXiv 2510.21048): the median relative error; how often the predicted peak, used as the limit,
  would have run out of memory (the highest fresh run above it), beside the same with the band's upper end as the
  limit (what tfmem judges "fits" with); and how much of a budget the batch it names leaves unused.
No TensorFlow here: it reads numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
END = "<!-- end of the generated part -->"
BASES = {"analytic": "analytic", "calibrated": "calibrated (`calibrate=True`)"}


@dataclass(frozen=True)
class Point:
    """One prediction against its fresh runs."""

    model: str
    basis: str
    batch: int
    predicted: float
    band: float
    runs: tuple[float, ...]
    below: float = 0.0  # the band's low side where wider (WhatIf.below); results of earlier runs have none

    @property
    def low_side(self) -> float:
        return max(self.band, self.below)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def error(self) -> float:
        return (self.predicted - self.median) / self.median

    @property
    def covered(self) -> bool:
        return self.predicted * (1 - self.low_side) <= self.median <= self.predicted * (1 + self.band)

    @property
    def over_peak(self) -> bool:
        """The predicted peak as the limit would have run out of memory: a fresh run went above it."""
        return max(self.runs) > self.predicted

    @property
    def over_band(self) -> bool:
        """The band's upper end as the limit would have run out of memory."""
        return max(self.runs) > self.predicted * (1 + self.band)


@dataclass(frozen=True)
class Named:
    """The batch a basis named for a budget, and what it used of it when run."""

    model: str
    basis: str
    budget: int
    batch: int | None
    runs: tuple[float, ...]

    @property
    def used(self) -> float | None:
        """The named batch's median peak, of the budget; 0 where it named none (the cell's own batch ran within
        it, so "none fits" leaves the whole budget unused); None where the batch was not run."""
        if self.batch is None:
            return 0.0
        return statistics.median(self.runs) / self.budget if self.runs else None

    @property
    def over(self) -> bool:
        return bool(self.runs) and max(self.runs) > self.budget


def points(results: dict) -> list[Point]:
    out = []
    for model in results["models"]:
        for cell in model["cells"]:
            for basis in BASES:
                for batch, runs in model["runs"].items():
                    out.append(
                        Point(
                            model["model"],
                            basis,
                            int(batch),
                            cell[basis][batch],
                            cell[f"{basis} band"][batch],
                            tuple(runs),
                            cell.get(f"{basis} band below", {}).get(batch, 0.0),
                        )
                    )
    return out


def named(results: dict) -> list[Named]:
    out = []
    for model in results["models"]:
        for cell in model["cells"]:
            for basis in BASES:
                batch = cell[f"{basis} named"]
                runs = model["named runs"].get(str(batch), []) if batch is not None else []
                out.append(Named(model["model"], basis, model["budget"], batch, tuple(runs)))
    return out


def _pct(value: float) -> str:
    return f"{value:+.0%}"


def _share(hits: int, of: int) -> str:
    return f"{hits} of {of} ({hits / of:.0%})" if of else "-"


def _took(results: dict) -> str:
    """How long the run took, and how many of its fresh runs it made (a runs file keeps them across invocations)."""
    counts = results.get("fresh runs")
    if not counts or not counts["reused"]:
        return f"{results['minutes']:.0f} min"
    return (
        f"{results['minutes']:.0f} min for the cells and {counts['new']} fresh runs; {counts['reused']} fresh runs "
        "were reused from the runs file of an earlier invocation"
    )


def render(results: dict) -> str:
    """The generated block: how the run was made, the errors per model, the scores per basis, the named batches."""
    scored = points(results)
    batches = sorted({p.batch for p in scored})
    lines = [
        f"Run: `{results['command']}` (TensorFlow {results['versions']['tensorflow']}, Keras "
        f"{results['versions']['keras']}, {results['versions']['cores']} cores; {_took(results)}). Each "
        f"model's cell runs at batch {results['anchor']} in trace mode and predicts every batch; each batch then runs "
        "in fresh processes, and each error is against the median of those runs (TensorFlow's peak over the cell's "
        "start). The named batch is `largest_batch(report, budget)` for a process that may grow by the most the "
        f"fresh runs grew it by at batch {max(batches)} (so that batch fitted it in every run), run fresh again.",
        "",
        "| model | fed as | runs per point | spread | "
        + " | ".join(f"{label}: error at batch {' / '.join(map(str, batches))}" for label in BASES.values())
        + " | calibrated basis |",
        "|---|---|---|---|" + "---|" * len(BASES) + "---|",
    ]
    for model in results["models"]:
        runs = model["runs"]
        spread = max((max(r) - min(r)) / statistics.median(r) for r in runs.values())
        cells = []
        for basis in BASES:
            mine = [p for p in scored if p.model == model["model"] and p.basis == basis]
            per_batch = []
            for batch in batches:
                errors = [p.error for p in mine if p.batch == batch]
                low, high = min(errors), max(errors)
                per_batch.append(_pct(low) if low == high else f"{_pct(low)}..{_pct(high)}")
            cells.append(" / ".join(per_batch))
        kinds = sorted({cell["calibrated basis"].split(" (")[0] for cell in model["cells"]})
        lines.append(
            f"| {model['model']} | {model['style']} | {min(len(r) for r in runs.values())} | {spread:.0%} | "
            + " | ".join(cells)
            + f" | {'; '.join(kinds)} |"
        )
    lines += [
        "",
        "| basis | points | within 10% / 15% / 20% of the median | worst | band printed | band contains the median "
        "| xMem: median error | xMem: peak as the limit would OOM | the band's upper end as the limit would OOM |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for basis, label in BASES.items():
        mine = [p for p in scored if p.basis == basis]
        errors = [abs(p.error) for p in mine]
        within = " / ".join(str(sum(e <= limit for e in errors)) for limit in (0.10, 0.15, 0.20))
        worst = max(mine, key=lambda p: abs(p.error))
        bands = sorted({p.band for p in mine})
        band = f"±{bands[0]:.0%}" if len(bands) == 1 else f"±{bands[0]:.0%} to ±{bands[-1]:.0%}"
        lows = sorted(p.low_side for p in mine if p.low_side > p.band)
        if lows:  # a low side wider than the band on some points (WhatIf.below)
            band += f"; below, on {len(lows)} points, −{statistics.median(lows):.0%} (median, at most −{lows[-1]:.0%})"
        lines.append(
            f"| {label} | {len(mine)} | {within} | {_pct(worst.error)} ({worst.model} at {worst.batch}) | {band} | "
            f"{_share(sum(p.covered for p in mine), len(mine))} | {statistics.median(errors):.1%} | "
            f"{_share(sum(p.over_peak for p in mine), len(mine))} | "
            f"{_share(sum(p.over_band for p in mine), len(mine))} |"
        )
    answers = named(results)
    lines += [
        "",
        "| model | budget (the process may grow by) | "
        + " | ".join(f"{label}: batch named, what it grew the process by, of the budget" for label in BASES.values())
        + " |",
        "|---|---|" + "---|" * len(BASES),
    ]
    for model in results["models"]:
        row = []
        for basis in BASES:
            mine = [a for a in answers if a.model == model["model"] and a.basis == basis]
            row.append(
                "; ".join(
                    "none fits: 0%"
                    if a.batch is None
                    else f"{a.batch}: {a.used:.0%}" + (" **over**" if a.over else "")
                    if a.used is not None
                    else f"{a.batch}: not run"
                    for a in mine
                )
            )
        lines.append(f"| {model['model']} | {model['budget'] / 2**20:.1f} MiB | " + " | ".join(row) + " |")
    lines.append("")
    for basis, label in BASES.items():
        mine = [a.used for a in answers if a.basis == basis and a.used is not None]
        over = sum(a.over for a in answers if a.basis == basis)
        if mine:
            lines.append(
                f"- {label}: the named batch used a median {statistics.median(mine):.0%} of the budget (xMem: "
                f"{1 - statistics.median(mine):.0%} left unused; lowest {min(mine):.0%}, highest {max(mine):.0%}); "
                f"{over} of {len(mine)} ran over it."
            )
    outside = render_outside(results)
    return "\n".join(lines + (["", *outside] if outside else [])) + "\n"


def render_outside(results: dict) -> list[str]:
    """What the fresh runs grew the process by besides TensorFlow's peak, per batch: the part a process margin
    covers. Its rise over the second-smallest batch (the cell's batch is not run fresh) is set against TF's peak
    at the same batch, as the margin is."""
    batches = sorted({int(b) for model in results["models"] for b in model["runs"]})
    if len(batches) < 3 or not all("grown" in model for model in results["models"]):
        return []  # no rise above a base batch to show
    base = str(batches[1])
    lines = [
        "| model | the process grew by besides TensorFlow's peak at batch "
        + " / ".join(map(str, batches))
        + f" (median of the fresh runs) | its most above batch {base}'s, of TensorFlow's peak there |",
        "|---|---|---|",
    ]
    for model in results["models"]:
        outside = {
            b: statistics.median(grown - tf for tf, grown in zip(model["runs"][b], model["grown"][b], strict=True))
            for b in model["runs"]
        }
        tf_peak = {b: statistics.median(model["runs"][b]) for b in model["runs"]}
        above = [((outside[b] - outside[base]) / tf_peak[b], int(b)) for b in model["runs"] if int(b) > int(base)]
        share, at = max(above)
        lines.append(
            f"| {model['model']} | "
            + " / ".join(f"{outside[str(b)] / 2**20:.0f}" for b in batches)
            + f" MiB | {_pct(share)} (at {at}) |"
        )
    return lines


def render_refusals(results: dict) -> str:
    """The refusal-time block of docs/preflight.md: each model's refusals, cold and warm probes side by side."""
    lines = [
        f"Run: `{results['command']}` (TensorFlow {results['versions']['tensorflow']}, Keras "
        f"{results['versions']['keras']}, {results['versions']['cores']} cores). Seconds from the cell's start to "
        "the refusal, each round building the model again in the cell (no kept replay answers it); a warm round's "
        f"probes were started by `%tfmem limit` and given {results['settle']:g} s to import TensorFlow.",
        "",
        "| model | batch refused | limit over the process | cold probes: each round (median) | warm probes: each "
        "round (median) | batch named |",
        "|---|---|---|---|---|---|",
    ]
    medians: dict[str, list[float]] = {"cold": [], "warm": []}
    for model in results["models"]:
        cells = []
        for kind in ("cold", "warm"):
            seconds = model[kind]
            medians[kind].append(statistics.median(seconds))
            cells.append(", ".join(f"{t:.1f}" for t in seconds) + f" ({statistics.median(seconds):.1f} s)")
        named = sorted({n for n in model["named"] if n is not None})
        lines.append(
            f"| {model['model']} | {model['batch']} | {model['headroom_mib']} MiB | {' | '.join(cells)} | "
            f"{', '.join(map(str, named)) or 'none'} |"
        )
    lines += [
        "",
        f"Median over the models' medians: cold {statistics.median(medians['cold']):.1f} s, warm "
        f"{statistics.median(medians['warm']):.1f} s.",
    ]
    return "\n".join(lines) + "\n"


def grow_words(grew: float, room: float, share: float, over: bool) -> str:
    """What a call grew the process by (bytes), of the room it had under the limit, and that share: "963 of 1524
    MiB: 63%", with " (over the limit)" where it went past it."""
    mib = 2**20
    return f"{grew / mib:.0f} of {room / mib:.0f} MiB: {share:.0%}" + (" (over the limit)" if over else "")


def render_programs(results: dict) -> str:
    """The public programs' block of docs/preflight.md (benchmarks/public_programs.py): per program, the oversized
    call's refusal, the named batch's call under the same limit, its use of the room and xMem's figures for it."""
    mib = 2**20
    ran = [row["program"] for row in results["programs"]]
    legacy = [name for name in results.get("tf_keras", ["ner"]) if name in ran]  # the first run did not record it
    on_legacy = "".join(f"the {name} program on tf_keras; " for name in legacy)
    lines = [
        f"Run: `{results['command']}` (TensorFlow {results['versions']['tensorflow']}, Keras "
        f"{results['versions']['keras']}; {on_legacy}{results['versions']['cores']} cores). Each "
        f"program in a fresh IPython shell, TensorFlow running, `%tfmem limit` at its RSS + "
        f"{results['headroom_mib']} MiB; a new model per cell, one epoch of at most three steps.",
        "",
        "| program | oversized call: batch, verdict, seconds, optimizer steps run | batch named (regions TF held "
        "beyond its bytes in use, which it is judged without) | its call: verdict "
        "(kept replay?), status | process peak over the cell's start, of the room under the limit | xMem: "
        "predicted growth's error | the prediction as the limit would run out |",
        "|---|---|---|---|---|---|---|",
    ]
    used, errors, over, runs_out = [], [], 0, 0
    for row in results["programs"]:
        if "error" in row:
            said = (row["error"].strip().splitlines() or ["no output"])[-1][:120]
            lines.append(f"| {row['program']} | did not run: {said} | | | | | |")
            continue
        a, b, score = row["oversized"], row.get("named"), row.get("score") or {}
        first = f"{a['batch']}, {a['verdict'] or 'not checked'}, {a['seconds']} s, {a['optimizer_steps']}"
        if not b:
            lines.append(f"| {row['program']} | {first} | none | | | | |")
            continue
        kept = "kept" if b["kept"] else "new probes"
        grew, room = b["hwm"] - b["rss_before"], row["limit_mib"] * mib - b["rss_before"]
        used.append(score["used"])
        over += bool(score["over_limit"])
        if "error" in score:
            errors.append(abs(score["error"]))
            runs_out += bool(score["prediction_as_limit_runs_out"])
        held = a.get("reusable") or 0  # not in the runs before it was recorded
        named = f"{a['named']}" + (f" ({held / mib:.0f} MiB of regions held)" if held >= mib else "")
        lines.append(
            f"| {row['program']} | {first} | {named} | {b['verdict'] or 'not checked'} ({kept}), "
            f"{b['status']} | {grow_words(grew, room, score['used'], score['over_limit'])}"
            + f" | {_pct(score['error']) if 'error' in score else ''} | "
            + ("yes" if score.get("prediction_as_limit_runs_out") else "no" if "error" in score else "")
            + " |"
        )
    restarted = [row for row in results["programs"] if row.get("after_restart")]
    if restarted:
        lines += [
            "",
            "Where a refusal said what a restart would let it name, that batch ran in another fresh process as after "
            "a restart (the program's data and code again, not its own fit, the same limit):",
            "",
            "| program | regions held at the refusal | batch named | about, after a restart | that call after a "
            "restart: how it was checked, status | process peak over the cell's start, of the room under the "
            "limit |",
            "|---|---|---|---|---|---|",
        ]
    for row in restarted:
        a, c = row["oversized"], row["after_restart"]
        first = f"| {row['program']} | {a['reusable'] / mib:.0f} MiB | {a['named'] or 'none'} | {a['restart']} |"
        if "run" not in c:
            lines.append(f"{first} did not run | |")
            continue
        run, limit = c["run"], c["limit_mib"] * mib
        grew, room = run["hwm"] - run["rss_before"], max(1, limit - run["rss_before"])
        checked = (
            f"pre-flight: {run['verdict']}"
            if run["verdict"]
            else "the limit capped TensorFlow's allocator (set before its first op: no pre-flight)"
        )
        lines.append(
            f"{first} {checked}, {run['status']} | {grow_words(grew, room, grew / room, run['hwm'] > limit)} |"
        )
    if used:
        lines += [
            "",
            f"The named batch's call used a median {statistics.median(used):.0%} of the room (lowest "
            f"{min(used):.0%}, highest {max(used):.0%}); {over} of {len(used)} went past the limit."
            + (
                f" xMem: median error of the predicted growth {statistics.median(errors):.1%}; the prediction alone "
                f"as the limit would have run out on {runs_out} of {len(errors)}."
                if errors
                else ""
            ),
        ]
    return "\n".join(lines) + "\n"


def render_gpu(results: dict) -> str:
    """benchmarks/gpu_from_cpu.py: two public T4 steps against what their CPU rebuilds predicted for that GPU."""
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    lines = [
        "| model | T4 step | its workspace | CPU step here | predicted for the T4 (workspace) | T4 vs predicted "
        "| band | T4's first step | 'fits' judged | tensors matched |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in results["models"]:
        below, above = m["band"]
        lines.append(
            f"| {m['model']} | {mib(m['gpu_step'])} | {mib(m['gpu_workspace_at_peak'])} | {mib(m['cpu_step'])} "
            f"| {mib(m['predicted'])} ({mib(m['predicted_workspace'])}) | {m['gpu_step'] / m['predicted'] - 1:+.0%} "
            f"| -{below:.0%} / +{above:.0%}: {'holds it' if m['in_band'] else 'misses'} "
            f"| {mib(m['gpu_lifetime_over_start'])} | {mib(m['upper'])}: {'fits' if m['fits'] else m['fits']} "
            f"| {mib(m['tensors_matched'])} of the T4's {mib(m['tensors_gpu'])} (the CPU's {mib(m['tensors_cpu'])}) |"
        )
    lines.append("")
    for m in results["models"]:
        only = lambda rows: ", ".join(f"{k} {mib(v)}" for k, v in rows) or "none"  # noqa: E731
        lines.append(
            f"- {m['model']} ({m['source']}): TensorFlow's limit {m['gpu_limit']:,} B, reckoned {m['limit_reckoned']:,}"
            f" B; largest batch named {m['largest_batch']:,}"
            + (
                " (the rows the rebuild trained on: fit runs them as one batch)"
                if m.get("rows") == m["largest_batch"]
                else ""
            )
            + f". Only on the T4: {only(m['gpu_only'])}. Only on the "
            f"CPU: {only(m['cpu_only'])}."
        )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Block:
    """A generated block: the page it sits in, the results file it renders, how."""

    page: Path
    results: Path
    render: Callable[[dict], str]

    @property
    def begin(self) -> str:
        return f"<!-- generated by benchmarks/doc_tables.py from {self.results.relative_to(ROOT)}: do not edit -->"

    def rendered(self) -> str:
        return self.render(json.loads(self.results.read_text()))

    def generated(self) -> str:
        """The page's block as it stands."""
        return self.page.read_text().split(self.begin, 1)[1].split(END, 1)[0].lstrip("\n")

    def write(self) -> None:
        """Replace the page's block (between its begin marker and END) with the rendering."""
        text = self.page.read_text()
        head, rest = text.split(self.begin, 1)
        _, tail = rest.split(END, 1)
        self.page.write_text(f"{head}{self.begin}\n{self.rendered()}{END}{tail}")


BLOCKS = [
    Block(ROOT / "docs" / "accuracy.md", ROOT / "benchmarks" / "results" / "predict_accuracy.json", render),
    Block(ROOT / "docs" / "accuracy.md", ROOT / "benchmarks" / "results" / "predict_accuracy_held.json", render),
    Block(ROOT / "docs" / "preflight.md", ROOT / "benchmarks" / "results" / "refusal_time.json", render_refusals),
    Block(ROOT / "docs" / "preflight.md", ROOT / "benchmarks" / "results" / "public_programs.json", render_programs),
    Block(
        ROOT / "docs" / "preflight.md", ROOT / "benchmarks" / "results" / "public_programs_more.json", render_programs
    ),
    Block(ROOT / "docs" / "gpu.md", ROOT / "benchmarks" / "results" / "gpu_from_cpu.json", render_gpu),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write every block into its page")
    args = parser.parse_args()
    for block in BLOCKS:
        if args.write:
            block.write()
        else:
            print(f"{block.page.relative_to(ROOT)}:\n{block.rendered()}")


if __name__ == "__main__":
    main()
