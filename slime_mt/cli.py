"""The ``slime-mt`` command: ``slime-mt COMMAND [flags]``; ``slime-mt --help`` lists every flag."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from slime_mt.config_parsing import (
    add_config_arguments,
    config_from_namespace,
    option_strings,
    pass_sglang_args,
    unrecognized,
)
from slime_mt.errors import (
    USER_ERRORS,
    CheckpointError,
    ConfigError,
    DumpError,
    InspectError,
    RolloutFailedError,
    RolloutRoleFailed,
    TrainerRankLost,
    WeightUpdateError,
)
from slime_mt.launch.ray.driver import dry_run_placement, run
from slime_mt.metrics import plot_run
from slime_mt.run_dir import LOG_FILE, claim_run_dir, release_run_dir, run_dir_of, tee_output, write_config
from slime_mt.stop import StopRequest

COMMANDS = {
    "train": "Run multi-turn RL training (flags below; --dry-run prints the resolved config).",
    "eval": "Evaluate the held-out datasets (--eval-config, --eval-prompt-data) on a checkpoint (--load) or an HF "
    "folder (--hf-checkpoint) with the flags of 'train', no trainer: RUN_DIR/eval.jsonl.",
    "serve": "Serve a HF model folder with the embedded engine (SGLang's HTTP API) on 127.0.0.1.",
    "plot": "Write PNG curves (reward, turns, lengths, timings) of a run directory's metrics.",
    "prepare-data": "Convert geo3k parquet, or draw synthetic geo3k-style problems, into prompt jsonl.",
    "inspect": "A run folder as one self-contained HTML page (curves, every dumped trajectory token by token), "
    "or a terminal summary (--text).",
    "convert-fp8": "Write an HF model folder as block-wise FP8 (e4m3, weight_scale_inv, the HF format) for the "
    "engines (--rollout-checkpoint).",
    "export-merged": "Fold a LoRA adapter (a PEFT folder, or a LoRA run's checkpoint) into its base model: an HF "
    "model folder for engines that serve no adapters.",
    "check-template": "Which tokenization path (append, strip_thinking, step-wise, retokenize) is exact for a "
    "model's chat template.",
}


def build_cli() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slime-mt",
        description="slime_mt: multi-turn RL for LLMs and VLMs (Megatron-core + SGLang-protocol engines).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser("train", help=COMMANDS["train"], description=COMMANDS["train"])
    train.add_argument(
        "--dry-run",
        action="store_true",
        default=argparse.SUPPRESS,
        help="Print the resolved configuration as YAML and exit.",
    )
    add_config_arguments(train)
    evaluate = sub.add_parser("eval", help=COMMANDS["eval"], description=COMMANDS["eval"])
    add_config_arguments(evaluate)
    serve = sub.add_parser("serve", help=COMMANDS["serve"], description=COMMANDS["serve"])
    serve.add_argument("--model-path", required=True, help="Hugging Face model folder.")
    serve.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1).")
    serve.add_argument("--port", type=int, default=30000, help="Port (0: any free port).")
    serve.add_argument("--max-batch-size", type=int, default=32, help="Requests decoded together.")
    serve.add_argument("--seed", type=int, default=0, help="Sampling seed for requests without sampling_seed.")
    serve.add_argument(
        "--cache-tokens", type=int, default=0, help="Tokens of KV state kept by the prefix cache (LRU); 0: off."
    )
    serve.add_argument("--enable-lora", action="store_true", help="Serve LoRA adapters by name (SGLang's flag).")
    serve.add_argument(
        "--lora-paths",
        nargs="+",
        metavar="NAME=PATH",
        help="Adapters loaded at start (PEFT folders; implies --enable-lora).",
    )
    serve.add_argument("--max-loras-per-batch", type=int, default=8, help="Adapters decoded in one batch (default 8).")
    serve.add_argument("--max-lora-rank", type=int, help="The largest adapter rank accepted (default: any).")
    plot = sub.add_parser("plot", help=COMMANDS["plot"], description=COMMANDS["plot"])
    plot.add_argument("run_dir", help="Run directory holding metrics.jsonl.")
    prep = sub.add_parser("prepare-data", help=COMMANDS["prepare-data"], description=COMMANDS["prepare-data"])
    prep.add_argument("--out", required=True, help="Output folder (train.jsonl, test.jsonl, images/).")
    prep.add_argument("--parquet", nargs="+", help="geo3k parquet file(s) on disk (fields problem, answer, images).")
    prep.add_argument("--synthetic", type=int, help="Draw N synthetic geo3k-style problems instead.")
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--test-fraction", type=float, default=0.1)
    check = sub.add_parser("check-template", help=COMMANDS["check-template"], description=COMMANDS["check-template"])
    check.add_argument("--hf-checkpoint", required=True, help="Model folder holding the tokenizer (and processor).")
    check.add_argument("--chat-template", help="A Jinja chat template file to check instead of the folder's.")
    check.add_argument("--tools", help="A JSON file with a list of tool schemas for the tool scenarios.")
    fp8 = sub.add_parser("convert-fp8", help=COMMANDS["convert-fp8"], description=COMMANDS["convert-fp8"])
    fp8.add_argument("--model-dir", required=True, help="The full-precision HF model folder (safetensors).")
    fp8.add_argument("--save-dir", required=True, help="Where the FP8 folder goes (replaced when it exists).")
    fp8.add_argument(
        "--strategy", default="block", choices=["block"], help="Block-wise scales (slime's default; the only one)."
    )
    fp8.add_argument(
        "--block-size", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLUMNS"), help="Default 128 128."
    )
    merged = sub.add_parser("export-merged", help=COMMANDS["export-merged"], description=COMMANDS["export-merged"])
    merged.add_argument("--hf-checkpoint", required=True, help="The base model folder the adapter was trained on.")
    merged.add_argument(
        "--lora-adapter-path",
        required=True,
        help="The adapter: a PEFT folder, a LoRA run's iter_* checkpoint, or its --save folder (the latest).",
    )
    merged.add_argument("--save-dir", required=True, help="Where the merged model folder goes (replaced).")
    inspect = sub.add_parser("inspect", help=COMMANDS["inspect"], description=COMMANDS["inspect"])
    inspect.add_argument("run_dir", help="Run directory (metrics.jsonl, config.yaml, the rollout dumps).")
    inspect.add_argument("--step", type=int, help="Only this step's dump (default: every dumped step).")
    inspect.add_argument("-o", "--output", help="Where the page goes (default RUN_DIR/report.html).")
    inspect.add_argument("--text", action="store_true", help="Print a summary instead of writing the page.")
    inspect.add_argument(
        "--dumps", help="The dumps' path with '{rollout_id}' (default: the run's --save-debug-rollout-data)."
    )
    parser.subcommands = sub.choices  # name -> its parser
    parser.epilog = (
        "Commands:\n"
        + "\n".join(f"  {k:<14} {v}" for k, v in COMMANDS.items())
        + "\n\nFlags of 'train', grouped by concern:\n"
        + _indent(_flag_sections(train.format_help()))
    )
    return parser


def _flag_sections(help_text: str) -> str:
    """The option sections of a subcommand's help, without its long usage line."""
    return help_text[help_text.index("\noptions:") + 1 :]


def _indent(text: str) -> str:
    return "\n".join("  " + line if line else line for line in text.splitlines())


def _interrupted(cfg, done: int, stop: StopRequest) -> str:
    """The last line of a run stopped by Ctrl-C or SIGTERM: where it stopped and how it goes on."""
    total = cfg.rollout.num_rollout
    if cfg.checkpoint.save:
        how = f"resume it with the same flags and --load {cfg.checkpoint.save}"
    else:
        how = "nothing was saved (no --save), so it cannot be resumed"
    return f"slime-mt train: stopped by {stop.signal_name} after step {done} of {total}; {how}"


def run_train(cfg) -> int:
    """Preflight every input (errors there: exit 2, nothing written), then train in the run folder,
    which gets ``config.yaml`` and ``train.log`` (everything printed) first. A run that fails on its
    way exits 1 with one line naming the cause (every sample failing), or the traceback; one that Ctrl-C
    or SIGTERM stops (after its step, saved) exits 130 or 143; a ``--load`` of a finished run says so and
    exits 0, touching nothing."""
    from slime_mt.driver import rollout_only
    from slime_mt.launch.ranks import train
    from slime_mt.preflight import finished_run, preflight

    preflight(cfg)
    finished = finished_run(cfg)
    if finished:
        print(f"slime-mt train: {finished}", file=sys.stderr)
        return 0
    stop = StopRequest()
    if cfg.debug.debug_rollout_only:
        train = rollout_only  # no model, no trainer ranks: this process rolls out
        if os.environ.get("RANK", "0") != "0":
            return 0
    run_dir = run_dir_of(cfg)
    stops: tuple[type, ...] = (RolloutFailedError, RolloutRoleFailed)  # a run that stops on its way: one line, exit 1
    if cfg.cluster.ray:
        train = run  # the driver starts every rank as a Ray actor; each runs launch.ranks.train
        stops += (TrainerRankLost,)
    elif os.environ.get("RANK", "0") != "0":  # torchrun's other ranks: rank 0 writes the run folder
        try:
            done = train(cfg, run_dir, stop)
        except (RolloutFailedError, RolloutRoleFailed):
            return 1  # rank 0 says why
        return stop.exit_code if done is not None and done < cfg.rollout.num_rollout else 0
    lock = claim_run_dir(run_dir, cfg)
    try:
        write_config(run_dir, cfg)
        with tee_output(run_dir / LOG_FILE):
            print(f"slime-mt train: run folder {run_dir}", flush=True)
            return _train_in(cfg, run_dir, train, stop, stops)
    finally:
        release_run_dir(lock)


def _train_in(cfg, run_dir, train, stop: StopRequest, stops: tuple[type, ...]) -> int:
    """The run in its claimed folder -> the exit code."""
    try:
        done = train(cfg, run_dir, stop)
        if done is not None and done < cfg.rollout.num_rollout:
            print(_interrupted(cfg, done, stop), file=sys.stderr)
            return stop.exit_code
    except stops as e:
        print(f"slime-mt train: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if not isinstance(e, USER_ERRORS):
            traceback.print_exc()
            return 1
        print(f"slime-mt train: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


def run_eval(cfg) -> int:
    """``slime-mt eval``: the held-out datasets' rows and plug-ins checked first (exit 2 naming what is
    wrong), then the evaluation, its figures printed and appended to ``RUN_DIR/eval.jsonl``."""
    from slime_mt.driver import eval_only
    from slime_mt.preflight import check_plugins
    from slime_mt.rollout.evaluation import load_eval_sets

    load_eval_sets(cfg)
    check_plugins(cfg)
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    with tee_output(run_dir / "eval.log"):
        steps = eval_only(cfg, run_dir)
    print(f"slime-mt eval: the weights after {steps} steps, evaluated into {run_dir / 'eval.jsonl'}")
    return 0


def run_check_template(ns) -> int:
    """Print one line per scenario and path, then the verdict; exit 0 (the check informs, it does not fail)."""
    from pathlib import Path

    from slime_mt.processing import load_tokenizer_or_processor, use_chat_template
    from slime_mt.rollout.template_check import check_template, load_tools, report

    try:
        if not Path(ns.hf_checkpoint).is_dir():
            raise ValueError(f"--hf-checkpoint {ns.hf_checkpoint}: not a folder")
        processor = load_tokenizer_or_processor(ns.hf_checkpoint)
        if ns.chat_template:
            use_chat_template(processor, ns.chat_template)
        tools = load_tools(ns.tools)
    except (OSError, ValueError) as e:
        print(f"slime-mt check-template: error: {e}", file=sys.stderr)
        return 2
    print(report(check_template(processor, tools)))
    return 0


def run_convert_fp8(ns) -> int:
    """``slime-mt convert-fp8``: the FP8 folder's path on stdout; exit 2 naming a bad input."""
    from pathlib import Path

    from slime_mt.engine.weights.fp8 import BlockFp8, convert_folder

    try:
        if not (Path(ns.model_dir) / "config.json").is_file():
            raise ConfigError(f"--model-dir {ns.model_dir}: not a model folder (no config.json)")
        print(convert_folder(ns.model_dir, ns.save_dir, BlockFp8(tuple(ns.block_size))))
    except (ConfigError, WeightUpdateError, OSError) as e:
        print(f"slime-mt convert-fp8: error: {e}", file=sys.stderr)
        return 2
    return 0


def run_export_merged(ns) -> int:
    """``slime-mt export-merged``: the merged folder's path on stdout; exit 2 naming a bad input."""
    from pathlib import Path

    from slime_mt.backends.megatron.checkpoint import read_latest
    from slime_mt.backends.megatron.peft import write_merged
    from slime_mt.engine.weights.adapters import ADAPTER_CONFIG

    try:
        adapter = Path(ns.lora_adapter_path)
        if not (adapter / ADAPTER_CONFIG).is_file() and (adapter / "latest").is_file():
            adapter = read_latest(adapter)  # a LoRA run's --save folder
        print(write_merged(ns.hf_checkpoint, adapter, ns.save_dir))
    except (CheckpointError, OSError, KeyError) as e:
        print(f"slime-mt export-merged: error: {e}", file=sys.stderr)
        return 2
    return 0


def run_inspect(ns) -> int:
    """``slime-mt inspect``: the page's path (or the summary) on stdout; exit 2 naming what is missing."""
    from slime_mt.inspection.report import text_summary, write_report

    try:
        if ns.text:
            print(text_summary(ns.run_dir, ns.step, ns.dumps))
        else:
            print(write_report(ns.run_dir, ns.output, ns.step, ns.dumps))
    except (InspectError, DumpError, OSError) as e:
        print(f"slime-mt inspect: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "megatron", "uvicorn"):  # one line per request / per layer otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    parser = build_cli()
    ns, extras = parser.parse_known_args(argv)
    if getattr(ns, "command", None) in ("train", "eval"):
        extras = pass_sglang_args(ns, extras)
    if extras:
        command = getattr(ns, "command", None)
        options = option_strings(parser.subcommands[command] if command else parser)
        print(f"slime-mt {command or ''}: error: {unrecognized(extras, options)}".replace(" :", ":"), file=sys.stderr)
        return 2
    if ns.command is None:
        parser.print_help()
        return 0
    if ns.command == "serve":
        from slime_mt.engine.embedded.lora import LoraServing, parse_lora_paths
        from slime_mt.engine.embedded.server import serve

        lora = None
        if ns.enable_lora or ns.lora_paths:  # --lora-paths implies --enable-lora, as in SGLang
            lora = LoraServing(parse_lora_paths(ns.lora_paths), ns.max_loras_per_batch, ns.max_lora_rank)
        serve(ns.model_path, ns.host, ns.port, ns.max_batch_size, ns.seed, ns.cache_tokens, lora)
        return 0
    if ns.command == "plot":
        try:
            for path in plot_run(ns.run_dir):
                print(path)
        except FileNotFoundError as e:
            print(f"slime-mt plot: error: {e}", file=sys.stderr)
            return 2
        return 0
    if ns.command == "prepare-data":
        from slime_mt.geo3k_data import prepare

        try:
            print(prepare(ns.out, ns.parquet, ns.synthetic, ns.seed, ns.test_fraction))
        except (ValueError, FileNotFoundError) as e:
            print(f"slime-mt prepare-data: error: {e}", file=sys.stderr)
            return 2
        return 0
    if ns.command == "check-template":
        return run_check_template(ns)
    if ns.command == "inspect":
        return run_inspect(ns)
    if ns.command == "convert-fp8":
        return run_convert_fp8(ns)
    if ns.command == "export-merged":
        return run_export_merged(ns)
    dry_run = getattr(ns, "dry_run", False)
    values = {k: v for k, v in vars(ns).items() if k not in ("command", "dry_run")}
    try:
        from slime_mt.preflight import slime_load

        cfg = slime_load(config_from_namespace(argparse.Namespace(**values)))
        if dry_run:  # the memory plan first, then the resolved settings, then what was checked
            from slime_mt.preflight import dry_run as check

            plan, checks = check(cfg)
            for line in plan:
                print(f"# dry run: {line}")
            print(cfg.to_yaml(), end="")
            for line in checks:
                print(f"# dry run: {line}")
            if cfg.cluster.ray:
                for line in dry_run_placement(cfg):
                    print(f"# placement: {line}")
            return 0
        if ns.command == "eval":
            return run_eval(cfg)
        return run_train(cfg)
    except Exception as e:
        if not isinstance(e, USER_ERRORS):
            raise
        print(f"slime-mt {ns.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
