"""Training step time on CPU: native bf16 GEMMs against fp32-emulated ones, per strategy.

Runs gpt_tiny (the default run's model, batch and sequence) with fp32, mixed_fp32, bf16
and collage_plus, each bf16 strategy once with ``train.cpu_bf16_gemm=native`` and once
with ``fp32``, on this CPU as it is and again with its instruction set restricted to AVX2
(``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``: what a CPU without AVX512-BF16 or
AMX runs). Each run is the real CLI in its own process; runs are repeated in rotating
order and the step time is the median over repeats. Ratios are against the fp32 step
under the same instruction set. A line per instruction set says what the restriction
did (torch's CPU capability, the start-up probe's GFLOP/s) and what ``auto`` picks.

    python scripts/bench_cpu_bf16.py --steps 8 --repeats 2

The table is printed and appended to docs/results-history.md (``--no-record`` to skip).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import parser, publish, table
from runs import python_json, quiet_run, run_training

ISAS = {
    "native": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
STRATEGIES = ("fp32", "mixed_fp32", "bf16", "collage_plus")
GEMMS = ("native", "fp32")  # the bf16 strategies' GEMMs: torch's own, or emulated in fp32
_PROBE = (
    "import json, torch; from collage_train.cpu_bf16 import probe_gflops; "
    "print(json.dumps([torch.backends.cpu.get_cpu_capability(), *probe_gflops()]))"
)


def probe(env: dict[str, str]) -> tuple[str, float, float]:
    """(torch's CPU capability, native bf16 GFLOP/s, emulated GFLOP/s) under ``env``."""
    capability, native, emulated = python_json(_PROBE, env=env)
    return capability, native, emulated


def configurations(
    isas: list[str], precisions: list[str], gemms: tuple[str, ...] = GEMMS
) -> list[tuple[str, str, str]]:
    """(isa, precision, gemm) for every run; fp32 (the baseline, always run) has no bf16
    product to emulate."""
    return [
        (isa, precision, gemm)
        for isa in isas
        for precision in ["fp32", *(p for p in precisions if p != "fp32")]
        for gemm in (("native",) if precision == "fp32" else gemms)
    ]


def step_seconds(isa: str, precision: str, gemm: str, args: argparse.Namespace) -> dict:
    overrides = [
        f"precision={precision}",
        f"train.cpu_bf16_gemm={gemm}",
        *quiet_run(args.steps),
        *args.overrides,
    ]
    with tempfile.TemporaryDirectory() as tmp:
        summary, _ = run_training(overrides, Path(tmp) / "run", env=ISAS[isa])
    return {
        "step_s": summary["global_batch_tokens"] / summary["tokens_per_s"],
        "final_train_loss": summary["final_train_loss"],
        "cpu_bf16_gemm": summary["cpu_bf16_gemm"],
    }


def render(rows: list[dict]) -> str:
    def cells(r: dict) -> list[object]:
        base = next(b for b in rows if b["isa"] == r["isa"] and b["precision"] == "fp32")
        low, high = r["step_s_range"]
        return [
            r["isa"], r["precision"], r["gemm"], f"{r['step_s']:.3f}", f"{low:.3f}-{high:.3f}",
            f"{r['step_s'] / base['step_s']:.2f}", f"{r['final_train_loss']:.4f}",
        ]  # fmt: skip

    return table(
        ["instruction set", "precision", "bf16 GEMMs", "step s (median)", "range",
         "x fp32 step", "final train loss"],
        map(cells, rows),
    )  # fmt: skip


def main() -> None:
    cli = parser(__doc__, steps=8, repeats=2, overrides=True)
    cli.add_argument("--isa", nargs="+", choices=list(ISAS), default=list(ISAS))
    cli.add_argument("--precisions", nargs="+", default=list(STRATEGIES))
    cli.add_argument(
        "--gemms",
        nargs="+",
        choices=GEMMS,
        default=list(GEMMS),
        help="the bf16 strategies' GEMMs: native, fp32 (emulated) or both (native bf16 "
        "GEMMs on an AVX2-only CPU take seconds per step)",
    )
    args = cli.parse_args()

    probes = {isa: probe(ISAS[isa]) for isa in args.isa}
    configs = configurations(args.isa, args.precisions, tuple(args.gemms))
    measured: dict[tuple[str, str, str], list[dict]] = {c: [] for c in configs}
    for repeat in range(args.repeats):
        shift = repeat % len(configs)
        for config in configs[shift:] + configs[:shift]:  # rotating order
            measured[config].append(step_seconds(*config, args))
            print(config, f"{measured[config][-1]['step_s']:.3f} s/step", flush=True)
    rows = []
    for (isa, precision, gemm), runs in measured.items():
        times = sorted(r["step_s"] for r in runs)
        rows.append(
            {
                "isa": isa,
                "precision": precision,
                "gemm": gemm if precision != "fp32" else "n/a",
                "step_s": statistics.median(times),
                "step_s_range": [times[0], times[-1]],
                "final_train_loss": runs[0]["final_train_loss"],
            }
        )
    notes = []
    for isa, (capability, native, emulated) in probes.items():
        pick = "fp32" if emulated > native else "native"
        notes.append(
            f"- {isa}: torch CPU capability {capability}; 256^3 GEMM native bf16 "
            f"{native:.1f} GFLOP/s, as fp32 {emulated:.1f} GFLOP/s; auto picks {pick}"
        )
    publish(
        args,
        "\n".join(notes) + "\n\n" + render(rows),
        {"probes": probes, "rows": rows},
        "CPU training step: native against fp32-emulated bf16 GEMMs",
        f"gpt_tiny, default batch (16 x 256 tokens), {args.steps} steps per run, "
        f"{args.repeats} repeats in rotating order; step time = tokens per step / "
        "steady tokens/s (first step excluded), median over repeats.",
    )


if __name__ == "__main__":
    main()
