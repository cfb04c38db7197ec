"""`python -m launcher recipe=<name> [key=value ...]`: compose, validate, plan, then run (or just print the plan)."""

from __future__ import annotations

import sys

from launcher import PROCESS_STARTED_AT
from launcher.clusters import cluster_kind, is_scheduled
from launcher.compose import available_options, compose_job, recipe_launch_line
from launcher.errors import EXIT_BAD_INPUT, EXIT_OK, ConfigError
from launcher.plan import build_plan, check_fits, format_plan
from launcher.run import run_job, warm_up_workers, worker_lines
from launcher.rundir import check_run_dir, create_run_dir, resolve_run_dir
from recipes.schema import save_config
from recipes.train import prepare

USAGE = """usage: python -m launcher recipe=<name> [group=<option> ...] [key=value ...] [--cfg job] [--help]

Train a recipe on a cluster; any config field can be overridden Hydra-style (key=value, group=option).
  --cfg job    print the composed config and exit
  --help       this text

Common fields: trainer.max_steps, seed, run.dir, run.overwrite, cluster.nproc, dry_run, ft.spares,
  ft=ckptless|checkpoint_restart|none, fault=kill_worker fault.rank=1 fault.step=20,
  data=text_files data.paths=[a.txt,b.txt], task=sft|lora data=chat data.paths=[chats.jsonl], lora.rank,
  trainer.global_batch_size, trainer.micro_batch_size, optim.lr,
  model.pretrained=<dir>, tokenizer.path=<dir>, model.hf_config.<field>. docs/config.md has the full reference.

Commands:
  python -m launcher ls                        recipes, tasks, data sources, clusters, ft modes and faults
  python -m launcher cp <recipe> <my.yaml>     a recipe to edit, every field written out; run it: recipe=my.yaml
  python -m launcher validate <overrides>      compose and check a job as a launch would; nothing is started
  python -m launcher drain <run dir> <host>    hand a running job's host over to spares and let it go
  python -m launcher export <run dir>          a LoRA run's adapters merged into its base, ready to serve

After a run:
  python -m launcher.report <run dir>    goodput table, time lost per failure by phase, cost in accelerator-hours,
                                         money and energy (--price-per-hour, --watts), timeline picture
  python -m launcher.simulate            the same trade-off at 64 to 131,072 accelerators (--help)

Exit codes: 0 completed, 2 bad input (nothing started), 3 the job failed while running,
  4 repeated failures without progress, 5 the training code raised the same error again after a replay
  (a bug: traceback shown), 130 interrupted."""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--help" in args or "-h" in args:
        print(help_text())
        return EXIT_OK
    print_cfg = _pop_cfg_flag(args)
    cluster = None
    try:
        composed = compose_job(args)
        if print_cfg:
            print(composed.yaml, end="")
            return EXIT_OK
        job = composed.job
        if not job.dry_run:
            cluster = warm_up_workers(job)
        run_dir = resolve_run_dir(job, recipe=composed.recipe)
        plan = build_plan(job)
        workers = worker_lines(job, run_dir=run_dir)
        if job.dry_run:
            print(format_plan(job, plan, recipe=composed.recipe, run_dir=run_dir, workers=workers))
            print("dry run: nothing was started or written")
            return EXIT_OK
        if not is_scheduled(job.cluster.kind) or job.cluster.memory_limit_gib is not None:
            check_fits(job, plan)  # (a scheduler places the job on its nodes, not on this machine)
        check_run_dir(run_dir, overwrite=job.run.overwrite, resume=job.resume)
        if is_scheduled(job.cluster.kind):
            cluster_kind(job.cluster.kind).check_submission(job)  # (Slurm checks the jobs; nothing submitted yet)
        prepare(job)
    except ValueError as error:  # ConfigError, and the recipe's checks (data, tokenizer, model fields)
        if cluster is not None:
            cluster.close()
        return _bad_input(error)
    create_run_dir(run_dir)
    save_config(job, run_dir / "config.yaml")
    print(format_plan(job, plan, recipe=composed.recipe, run_dir=run_dir, workers=workers), flush=True)
    return run_job(job, run_dir=run_dir, recipe=composed.recipe, started_at=PROCESS_STARTED_AT, warm=cluster)


def help_text() -> str:
    options = available_options()
    lines = [USAGE, "", "Recipes:"]
    lines += [f"  {name:<14} {recipe_launch_line(name)}" for name in options.pop("recipe", [])]
    lines += ["", "Config groups (group=option):"]
    lines += [f"  {group:<14} {', '.join(names)}" for group, names in options.items()]
    return "\n".join(lines)


def _pop_cfg_flag(args: list[str]) -> bool:
    for flag in ("--cfg", "-c"):
        if flag in args:
            i = args.index(flag)
            value = args[i + 1] if i + 1 < len(args) else None
            if value != "job":
                raise SystemExit(_bad_input(ConfigError(f"{flag} takes 'job' (print the composed config)")))
            del args[i : i + 2]
            return True
    return False


def _bad_input(error: Exception) -> int:
    print(f"error: {error}", file=sys.stderr)
    return EXIT_BAD_INPUT
