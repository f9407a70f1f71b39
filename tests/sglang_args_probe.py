"""Run by ``.venv-sglang``'s interpreter: SGLang's own server-argument path for each command line.

``python tests/sglang_args_probe.py '<json list of argv lists>'`` prints one JSON object per command
line: ``{"ok": true, <field>: value...}`` or ``{"ok": false, "error": "<type>: <message>"}``. The
steps are the launcher's (``sglang.srt.entrypoints.engine``): ``prepare_server_args`` (its argparse
parser), ``resolve_once`` and ``check_server_args`` (the checks that assert, LoRA's among them).
Resolution needs a platform: on a machine without an accelerator the caller sets
``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU platform); the checks read the same fields either way.
"""

import json
import sys

from sglang.srt.server_args import prepare_server_args

FIELDS = (
    "enable_lora",
    "lora_target_modules",
    "max_lora_rank",
    "enable_memory_saver",
    "enable_weights_cpu_backup",
)


def probe(argv: list[str]) -> dict:
    try:
        args = prepare_server_args(argv)
        args.resolve_once()
        args.check_server_args()
    except (AssertionError, ValueError, RuntimeError, TypeError, SystemExit) as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    values = {name: getattr(args, name) for name in FIELDS}
    values["lora_target_modules"] = sorted(values["lora_target_modules"] or [])
    return {"ok": True, **values}


if __name__ == "__main__":
    for argv in json.loads(sys.argv[1]):
        print("PROBE " + json.dumps(probe(argv)), flush=True)
