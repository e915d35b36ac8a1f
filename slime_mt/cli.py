"""The ``slime-mt`` command: ``slime-mt COMMAND [flags]``; ``slime-mt --help`` lists every flag."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

import yaml

from slime_mt.config import GROUPS, ConfigError, add_config_arguments, config_from_namespace

COMMANDS = {
    "train": "Run multi-turn RL training (flags below; --dry-run prints the resolved config).",
    "serve": "Serve a HF model folder with the embedded engine (SGLang's HTTP API) on 127.0.0.1.",
}


def build_cli() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slime-mt",
        description="slime_mt: multi-turn RL for LLMs and VLMs (Megatron-core + SGLang-protocol engines).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser("train", help=COMMANDS["train"], description=COMMANDS["train"])
    train.add_argument("--dry-run", action="store_true", default=argparse.SUPPRESS,
                       help="Print the resolved configuration as YAML and exit.")
    add_config_arguments(train)
    serve = sub.add_parser("serve", help=COMMANDS["serve"], description=COMMANDS["serve"])
    serve.add_argument("--model-path", required=True, help="Hugging Face model folder.")
    serve.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1).")
    serve.add_argument("--port", type=int, default=30000, help="Port (0: any free port).")
    serve.add_argument("--max-batch-size", type=int, default=32, help="Requests decoded together.")
    serve.add_argument("--seed", type=int, default=0, help="Sampling seed for requests without sampling_seed.")
    parser.epilog = "Commands:\n" + "\n".join(f"  {k:<8} {v}" for k, v in COMMANDS.items()) + \
        "\n\nFlags of 'train', grouped by concern:\n" + _indent(_flag_sections(train.format_help()))
    return parser


def _flag_sections(help_text: str) -> str:
    """The option sections of a subcommand's help, without its long usage line."""
    return help_text[help_text.index("\noptions:") + 1:]


def _indent(text: str) -> str:
    return "\n".join("  " + line if line else line for line in text.splitlines())


def resolved_yaml(cfg) -> str:
    data = {group: dataclasses.asdict(getattr(cfg, group)) for group in GROUPS}
    if cfg.custom:
        data["custom"] = cfg.custom
    return yaml.safe_dump(data, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_cli()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 0
    if ns.command == "serve":
        from slime_mt.engine.server import serve

        serve(ns.model_path, ns.host, ns.port, ns.max_batch_size, ns.seed)
        return 0
    dry_run = getattr(ns, "dry_run", False)
    values = {k: v for k, v in vars(ns).items() if k not in ("command", "dry_run")}
    try:
        cfg = config_from_namespace(argparse.Namespace(**values))
    except ConfigError as e:
        print(f"slime-mt {ns.command}: error: {e}", file=sys.stderr)
        return 2
    if ns.command == "train" and dry_run:
        print(resolved_yaml(cfg), end="")
        return 0
    print("slime-mt train: the training loop is not available in this version; use --dry-run", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
