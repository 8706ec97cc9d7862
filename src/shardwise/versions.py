"""Which shardwise and which libraries: `shardwise --version`, `shardwise version --full`, and
the versions a checkpoint manifest records. Read from the installed distributions' metadata
(importlib.metadata), so nothing heavy is imported; only `--full` asks torch for its CUDA and
NCCL builds."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from shardwise import __version__

# what a run's numbers depend on: the engines, the model code, the adapters, the data
LIBRARIES = ("torch", "deepspeed", "transformers", "accelerate", "peft", "datasets", "safetensors", "bitsandbytes")
MANIFEST_PACKAGES = ("shardwise", "torch", "deepspeed", "transformers")


def run_versions() -> dict[str, str]:
    """What a run records (checkpoint manifests, summary.json): the installed shardwise, torch,
    deepspeed and transformers (those not installed are left out)."""
    return {k: v for k, v in package_versions(MANIFEST_PACKAGES).items() if v is not None}


def package_versions(packages: tuple[str, ...]) -> dict[str, str | None]:
    """Each package's installed version, None where it is not installed."""
    out: dict[str, str | None] = {}
    for pkg in packages:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def torch_builds() -> dict[str, str | None]:
    """The CUDA and NCCL torch was built with (None on a CPU build, or without torch)."""
    try:
        import torch
    except ImportError:
        return {"cuda": None, "nccl": None}
    nccl = None
    if torch.version.cuda is not None:
        try:
            nccl = ".".join(str(p) for p in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):
            nccl = None
    return {"cuda": torch.version.cuda, "nccl": nccl}


def full_report() -> dict[str, str | None]:
    import platform

    return {"shardwise": __version__, "python": platform.python_version()} | package_versions(LIBRARIES) \
        | {f"torch {k}": v for k, v in torch_builds().items()}
