"""The ``radixserve`` command line."""

from __future__ import annotations

import argparse
import sys


def _init_model(args: argparse.Namespace) -> int:
    from engine.model_init import write_model

    path = write_model(args.path, args.preset, seed=args.seed)
    print(f"wrote the {args.preset} model to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="radixserve", description="Prefix-aware LLM serving on Ray Serve.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("init-model", help="write a small random-weight Llama with a byte-level tokenizer")
    p.add_argument("path", help="folder to write (created if missing)")
    p.add_argument("--preset", default="tiny",
                   choices=["tiny", "bench", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_init_model)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
