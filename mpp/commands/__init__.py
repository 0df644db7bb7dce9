"""``mpp``: one command, a subcommand per tool, each a thin call to the tool's own ``main``
(``mpp pretrain --help`` is that tool's help). The scripts and ``python -m`` forms stay: the
launcher runs ``deepspeed pretrain/run.py ...`` or ``deepspeed --module mpp.commands.pretrain``."""

from __future__ import annotations

import atexit
import gc
import importlib
import sys

# A process started through here (``mpp X``, pretrain/run.py, downstream/*.py, so each rank) ends
# without the interpreter's last full collection (gc.freeze moves every object out of its reach):
# over torch's and DeepSpeed's objects it took about 2 s of each exit on a CPU (BENCHMARKS.md,
# "Process start and exit"). Atexit handlers still run, objects still go by reference count;
# only cyclic garbage is left for the process's end to free.
atexit.register(gc.freeze)

# name -> (module with main(argv), one line for ``mpp --help``)
COMMANDS = {
    "pretrain": (
        "mpp.commands.pretrain",
        "pretrain a ViT (MPP, MAE, HPM, SimMIM) under DeepSpeed; also --plan, --submit",
    ),
    "finetune": (
        "mpp.commands.finetune",
        "fine-tune an encoder for classification (every label or a few)",
    ),
    "probe": (
        "mpp.commands.probe",
        "linear probe of a frozen encoder (--protocol fast|mae|dinov2, --layers all)",
    ),
    "knn": ("mpp.commands.knn", "weighted k-NN of a frozen encoder (k = 20, T = 0.07)"),
    "ablate": (
        "mpp.commands.ablate",
        "a grid of pretraining settings x seeds, evaluated and tabulated; --submit, --status",
    ),
    "export": ("mpp.hub.export", "weights out: safetensors, timm, Hugging Face"),
    "config": (
        "mpp.commands.config",
        "what a config key means (--explain KEY), or a config resolved",
    ),
    "plan": (
        "mpp.tools.planner.__main__",
        "plan a run on N GPUs on this machine: memory, FLOPs, step time, recipe",
    ),
    "doctor": (
        "mpp.tools.doctor.__main__",
        "check a GPU node (or this machine) for a pretraining run",
    ),
    "shards": ("mpp.data.shards", "write WebDataset shards from an image folder"),
    "viz": ("mpp.tools.viz", "picture what an objective sees and predicts, from a run"),
    "masks": ("mpp.tools.masking_viz", "picture every masking strategy"),
    "plot": ("mpp.tools.plot", "a run's curves (loss, lr, monitor) in one PNG"),
    "demo": (
        "mpp.tools.demo",
        "the main job on the built-in dataset: pretrain, few labels, a table",
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {line}" for name, (_, line) in COMMANDS.items()]
    return "\n".join(
        [
            "usage: mpp COMMAND [ARGS ...]      (mpp COMMAND --help for its arguments)",
            "",
            "masked-patch pretraining of Vision Transformers: MPP, MAE, HPM, SimMIM under DeepSpeed ZeRO,",
            "from WebDataset shards; fine-tuning, probes and exports. Commands:",
            "",
            *lines,
            "",
            "Under the launcher: deepspeed --num_gpus 8 --module mpp.commands.pretrain --config mae_b16",
            "(or the clone's deepspeed pretrain/run.py --config mae_b16). The Python API: import mpp.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] in ("-V", "--version"):
        from mpp import __version__

        print(f"mpp {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"mpp: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    sys.argv = [f"mpp {name}", *rest]  # each tool's argparse names itself "mpp NAME"
    result = module.main(rest)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
