"""FUSELENS_LOG=capture,autograd,schedule,codegen (or `all`) prints what those stages build:
each stage logs at DEBUG on the logger `fuselens.<stage>`."""
import logging
import os

STAGES = ("capture", "ops", "autograd", "lower", "schedule", "codegen", "runtime")


def configure(spec: str) -> None:
    names = STAGES if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise ValueError(f"FUSELENS_LOG: unknown stage(s) {', '.join(unknown)}; "
                         f"use any of {', '.join(STAGES)} or 'all'")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    for n in names:
        logger = logging.getLogger(f"fuselens.{n}")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)


if os.environ.get("FUSELENS_LOG"):
    configure(os.environ["FUSELENS_LOG"])
