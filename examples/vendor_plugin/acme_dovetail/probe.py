"""The toy device's cheap probe: no torch import, no device touched."""

import os

from dovetail.platform import ProbeResult


def probe() -> ProbeResult:
    if os.environ.get("DOVETAIL_TOY_PRESENT", "1") == "0":
        return ProbeResult.no("no toy accelerator present (DOVETAIL_TOY_PRESENT=0)")
    return ProbeResult.ok("1 toy accelerator (emulated on the CPU)")
