"""python -m benchmarks SUITE [--quick] [--out FILE.json] [suite options]   (from a clone's root)

Suites: cpu-step, attention, data, zero, preview, monitor, gpu-step (GPU only). Prints the suite's tables and
writes its JSON (default runs/benchmarks/SUITE[-quick].json).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks import SUITES, suite
from benchmarks.common import Unavailable, machine_info, write_json


def parse_args(argv: list[str] | None = None) -> tuple[str, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name in SUITES:
        module = suite(name)
        summary = " ".join(module.__doc__.split("\n\n")[0].split()).removeprefix(f"{name}: ")
        sp = sub.add_parser(
            name,
            help=summary,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sp.add_argument("--quick", action="store_true", help="the small form the test suite runs")
        sp.add_argument("--out", help="JSON output (default runs/benchmarks/SUITE[-quick].json)")
        if hasattr(module, "add_arguments"):
            module.add_arguments(sp)
    args = p.parse_args(argv)
    return args.suite, args


def main(argv: list[str] | None = None) -> int:
    name, args = parse_args(argv)
    module = suite(name)
    options = {k: v for k, v in vars(args).items() if k not in ("suite", "quick", "out")}
    # the load before the run is what the run competes with; the load after says if it changed
    machine = machine_info(sys.argv[1:] if argv is None else argv)
    try:
        result = module.run(quick=args.quick, **options)
    except Unavailable as e:
        print(f"error: {name}: {e}", file=sys.stderr)
        return 2
    machine["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    result = {"suite": name, "quick": args.quick, "machine": machine, **result}
    m = machine
    print(
        f"# {name}{' (quick)' if args.quick else ''}: {m['date_utc']}, {m['cpu_model']} x{m['cpu_cores']}, "
        f"load {m['load_avg_1_5_15']} -> {m['load_avg_after']}"
    )
    print(module.render(result))
    out = Path(args.out or f"runs/benchmarks/{name}{'-quick' if args.quick else ''}.json")
    print(f"-> {write_json(result, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
