"""Start-up time of a recipe: model load, the memory probe, the first step; memory_probe sweep against auto.

Each row is a fresh process that builds the recipe's trainer (load: the model, the adapters, the
start-up checks; the toy base and the converted SmolLM2 are cached before the first row), then trains one
step with no evaluation. The probe's seconds are the plan's own (summary.json `memory.probe_seconds`);
the first step is train()'s time less the probe. `sweep` is the probe before memory_probe auto
(a sweep of measured passes); `auto` takes the plan from the model's shapes when it is far under the
budget, else measures one pass at the size the shapes give. The two alternate over --repeats rounds,
alone on the machine; the table gives medians and the ratio auto/sweep.

    python benchmarks/startup.py                                    # toy-addition and the SmolLM2 recipe
    python benchmarks/startup.py --recipes toy-addition --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import print_markdown_table, run_worker

MODES = ("sweep", "auto")


def worker(recipe: str, mode: str) -> None:
    from lora_grpo import GRPOTrainer
    from lora_grpo.cli import load_config

    start = time.perf_counter()
    sets = [f"memory_probe={mode}", "max_steps=1", "eval_dataset=null", "save_steps=0", "disable_tqdm=true"]
    config = load_config(recipe, [*sets, f"output_dir={tempfile.mkdtemp()}"])
    trainer = GRPOTrainer(config)
    load = time.perf_counter() - start
    summary = trainer.train()
    probe = summary["memory"]["probe_seconds"]
    print(
        "RESULT "
        + json.dumps(
            {
                "load": load,
                "probe": probe,
                "first_step": summary["seconds"] - probe,
                "total": time.perf_counter() - start,
                "probe_path": summary["memory"]["probe"],
                "micro_batch_size": summary["micro_batch_size"],
            }
        ),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=["toy-addition", "smollm2-135m-chat-sum"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("RECIPE", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    rows = []
    for recipe in args.recipes:
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        # untimed: builds or converts the recipe's base into the cache, as a user's first run does
        run_worker([sys.executable, __file__, "--worker", recipe, "auto"], f"{recipe} warm-up")
        for r in range(args.repeats):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                run = run_worker([sys.executable, __file__, "--worker", recipe, mode], f"{recipe} {mode}")
                print(recipe, mode, json.dumps(run), flush=True)
                runs[mode].append(run)
        med = {
            m: {k: statistics.median(x[k] for x in runs[m]) for k in ("load", "probe", "first_step", "total")}
            for m in MODES
        }
        for mode in MODES:
            rows.append(
                [recipe, mode, runs[mode][0]["probe_path"], str(runs[mode][0]["micro_batch_size"])]
                + [f"{med[mode][k]:.1f}" for k in ("load", "probe", "first_step", "total")]
                + [f"{med[mode]['total'] / med['sweep']['total']:.2f}"]
            )
    print_markdown_table(
        [
            "recipe",
            "memory_probe",
            "what the probe did",
            "micro_batch_size",
            "load s",
            "probe s",
            "first step s",
            "start-up s",
            "vs sweep",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
