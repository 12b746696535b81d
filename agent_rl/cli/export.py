"""``agent-rl export RUN_OR_BUNDLE OUT [--merge-lora]``: a trained policy as a standard Hugging
Face folder (``agent_rl.policies.export``)."""

from __future__ import annotations

import argparse

from agent_rl.cli.common import CLIError, command, echo, ignore_library_deprecations


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="RUN_OR_BUNDLE",
                        help="a run directory (its newest complete bundle: the final one after "
                             "a finished run) or a checkpoint bundle folder")
    parser.add_argument("out", metavar="OUT", help="the folder to write (new or empty)")
    parser.add_argument("--merge-lora", action="store_true",
                        help="a LoRA run: merge the adapter into the base weights and write full "
                             "weights (default: a PEFT adapter folder over the base model)")
    parser.add_argument("--force", action="store_true",
                        help="replace OUT when it exists and is not empty")
    parser.add_argument("--model", default=None, metavar="ID",
                        help="the base model of a bundle without its run's contract (default: "
                             "the run's model.id)")


@command("export", "write a run's trained policy as a Hugging Face folder (weights, tokenizer, "
                   "model card)", _export_arguments)
def export(args: argparse.Namespace) -> int:
    from agent_rl.policies.export import ExportError
    from agent_rl.policies.export import export as export_policy

    ignore_library_deprecations()
    try:
        done = export_policy(args.source, args.out, merge_lora=args.merge_lora, force=args.force,
                             model_id=args.model)
    except ExportError as exc:
        raise CLIError(str(exc)) from exc
    weights = (f"a PEFT adapter over {done.base_model}" if done.adapter else
               f"full, LoRA merged, {done.dtype}" if done.merged else f"full, {done.dtype}")
    loader = "AutoPeftModelForCausalLM" if done.adapter else "AutoModelForCausalLM"
    echo(f"exported {done.bundle} (step {done.step})\n"
         f"  to:        {done.out}\n"
         f"  weights:   {weights}\n"
         "  also:      tokenizer with its chat template, generation config, README.md card\n"
         f"  load with: {loader}.from_pretrained({str(done.out)!r})")
    if args.merge_lora and not done.merged:
        echo("  (the run trained every weight: --merge-lora had no adapter to merge)")
    return 0
